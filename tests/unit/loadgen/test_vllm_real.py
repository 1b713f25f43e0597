"""How `loadgen.vllm_real` starts the real server (no server started here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loadgen.vllm_real import RealVllm, isa_path, split_cpus


def test_worker_runs_in_the_engine_core_process_by_default() -> None:
    cmd = RealVllm(port=1234).command(Path("python"))
    i = cmd.index("--distributed-executor-backend")
    assert cmd[i + 1] == "uni"
    assert RealVllm(port=1234, executor="mp").command(Path("python"))[i + 1] == "mp"


def test_unknown_executor_is_rejected() -> None:
    with pytest.raises(ValueError, match="executor"):
        RealVllm(executor="ray")


def test_unknown_isa_is_rejected_and_avx2_gets_its_shim() -> None:
    with pytest.raises(ValueError, match="isa"):
        RealVllm(isa="sse2")
    assert isa_path("native") is None
    shim = isa_path("avx2")
    assert shim is not None
    text = (shim / "sitecustomize.py").read_text()
    assert 'ONEDNN_MAX_CPU_ISA"] = "AVX2"' in text and "_is_avx512_supported = " in text
    compile(text, "sitecustomize.py", "exec")  # it is valid Python


def test_split_cpus_gives_each_side_its_own_cpus() -> None:
    mine = os.sched_getaffinity(0)
    engine, front = split_cpus()
    assert engine and front
    if len(mine) >= 2:
        assert engine.isdisjoint(front)
        assert engine | front == mine
        assert len(engine) <= len(front)
    else:
        assert engine == front == mine


def _state(pid: int) -> str:
    """The process state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_quiet_suspends_every_other_server_and_resumes_it() -> None:
    """`quiet()` stops the other live servers' process groups and continues them after,
    even when the block raises (stand-in processes: `sleep` in a session of its own)."""
    import subprocess

    measured, other = RealVllm(port=1), RealVllm(port=2)
    for s in (measured, other):
        s.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        RealVllm._live.add(s)
    assert other.proc is not None and measured.proc is not None
    try:
        with pytest.raises(RuntimeError), measured.quiet():
            assert _state(other.proc.pid) == "T"
            assert _state(measured.proc.pid) != "T"
            raise RuntimeError("the measurement failed")
        assert _state(other.proc.pid) != "T"
    finally:
        measured.stop(grace_s=1)
        other.stop(grace_s=1)
    assert measured not in RealVllm._live and other not in RealVllm._live
