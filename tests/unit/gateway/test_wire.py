"""`serve --workers N`: the `workers` setting, and what crosses the worker-authority socket
(errors raised again as the same class, jobs with their predicted distribution)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import build_parser, overrides
from gateway.config import ConfigError, TrafficClass, load
from gateway.errors import (
    GatewayError,
    QueueFull,
    QueueTimeout,
    Shed,
    UnknownClass,
    UpstreamFailed,
)
from gateway.observability.metrics import RequestTrace
from gateway.scheduling.dispatcher import Ticket
from gateway.serving.openai_api import parse_call
from gateway.workers import wire
from gateway.workers.supervisor import worker_config
from policies import Job, LengthDist

BACKEND = {"backends": [{"url": "http://a:1"}]}


def test_workers_from_flag_env_and_file_default_one() -> None:
    assert load(None, BACKEND, {}).workers == 1
    assert load(None, BACKEND, {"SAGESCHED_WORKERS": "3"}).workers == 3
    args = build_parser("serve").parse_args(["--backend", "http://x:1", "--workers", "4"])
    assert load(None, overrides(args), {"SAGESCHED_WORKERS": "3"}).workers == 4
    with pytest.raises(ConfigError, match="workers"):
        load(None, {**BACKEND, "workers": 0}, {})


@pytest.mark.parametrize(
    "error",
    [
        QueueFull("full", retry_after_s=7),
        Shed("shed", retry_after_s=3),
        QueueTimeout("waited 1 s"),
        UpstreamFailed("tried 3"),
        UnknownClass("no such class"),
        GatewayError("internal"),
    ],
)
def test_an_error_crosses_as_the_same_error(error: GatewayError) -> None:
    back = wire.rebuild_error(wire.unpack(wire.pack({"op": "error", **wire.error_fields(error)})))
    assert type(back) is type(error)
    assert (back.status, back.body(), back.headers()) == (error.status, error.body(),
                                                           error.headers())  # fmt: skip
    assert back.outcome is error.outcome


def test_a_job_crosses_with_its_prediction() -> None:
    call = parse_call("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 50, "stream": True}, "acme")  # fmt: skip
    dist = LengthDist([3.0, 10.0, 40.0], [0.2, 0.5, 0.3])
    ticket = Ticket(call=call, trace=RequestTrace("m", 12.5, "fcfs"), klass=TrafficClass("std"))
    job = Job(id=7, arrival_s=12.5, prompt_tokens=3, max_tokens=50, tenant="acme", dist=dist,
              rank_score=0.25, ctx=ticket)  # fmt: skip
    fields = wire.unpack(wire.pack({"op": "admit", "rid": job.id, "job": wire.job_fields(job)}))
    got = fields["job"]
    assert (got["arrival"], got["model"], got["tenant"], got["klass"]) == (12.5, "m", "acme", "std")
    assert got["continuable"] and got["max_tokens"] == 50 and got["rank_score"] == 0.25
    back = wire.dist_of(got)
    assert back is not None
    assert back.support.tolist() == dist.support.tolist()
    assert back.probs.tolist() == pytest.approx(dist.probs.tolist(), abs=1e-15)


def test_each_worker_writes_its_own_files(tmp_path: Path) -> None:
    snapshot = tmp_path / "history.bin"
    snapshot.write_bytes(b"worker 0's history")
    config = load(None, {**BACKEND, "workers": 3, "capture": {"dir": str(tmp_path / "cap")},
                         "predictor": {"snapshot_path": str(snapshot)}}, {})  # fmt: skip
    zero, two = worker_config(config, 0), worker_config(config, 2)
    assert zero.predictor.snapshot_path == str(snapshot)
    assert two.predictor.snapshot_path == f"{snapshot}.worker-2"
    assert Path(f"{snapshot}.worker-2").read_bytes() == b"worker 0's history"  # its start
    assert (zero.capture.dir, two.capture.dir) == (str(tmp_path / "cap" / "worker-0"),
                                                   str(tmp_path / "cap" / "worker-2"))  # fmt: skip
    assert worker_config(load(None, BACKEND, {}), 1).capture.dir is None
    shared = load(None, {**BACKEND, "shared_learning": {"redis_url": "redis://r:6379",
                                                        "replica_id": "gw-a"}}, {})  # fmt: skip
    assert worker_config(shared, 1).shared_learning.replica_id == "gw-a-worker-1"
    assert worker_config(load(None, BACKEND, {}), 1).shared_learning.replica_id == ""
