"""How `loadgen.vllm_real` starts the real server (no server started here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loadgen.vllm_real import RealVllm, split_cpus


def test_worker_runs_in_the_engine_core_process_by_default() -> None:
    cmd = RealVllm(port=1234).command(Path("python"))
    i = cmd.index("--distributed-executor-backend")
    assert cmd[i + 1] == "uni"
    assert RealVllm(port=1234, executor="mp").command(Path("python"))[i + 1] == "mp"


def test_unknown_executor_is_rejected() -> None:
    with pytest.raises(ValueError, match="executor"):
        RealVllm(executor="ray")


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
