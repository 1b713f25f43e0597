"""`RealVllm(isa="avx2")`: the vLLM CPU build run as on a CPU without AVX-512 is another
machine kind to the real-engine tests (slow: one server start, a few seconds of probes).

Its bf16 GEMMs run several times slower while the fixed work per iteration does not, so the
balance probe (`fit_cpu.machine_balance`) reads it as shifted: prefill far slower against
the fixed work than on the machine the `cpu-tiny-vllm` profile was fitted on
(docs/emulator.md, "Another machine kind")."""

from __future__ import annotations

import pytest

from loadgen.engine.fit_cpu import BALANCE_FLOOR, machine_balance
from loadgen.vllm_real import CACHE, RealVllm

pytestmark = pytest.mark.slow


async def test_avx2_server_reads_as_another_machine_kind() -> None:
    with RealVllm(isa="avx2", log_path=CACHE / "vllm-avx2.log") as server:
        balance = await machine_balance(server.url, server.name)
    # measured 7-12; the native build, running its AVX-512 kernels, read 1.2-1.7
    assert balance.shifted and balance.prefill_ratio >= BALANCE_FLOOR, balance
