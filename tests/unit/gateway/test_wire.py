"""`serve --workers N`: the `workers` setting, and what crosses the worker-authority socket
(errors raised again as the same class, jobs with their predicted distribution)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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


def test_an_embedding_crosses_exactly() -> None:
    """A worker's prompt embedding reaches the host's predictor bit for bit (float32), as one
    line of a few kB."""
    vec = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    line = wire.pack({"op": "learn", "vector": wire.vector_field(vec)})
    back = wire.vector_of(wire.unpack(line)["vector"])
    assert back.dtype == np.float32 and np.array_equal(back, vec)
    assert len(line) < 2_200


def test_a_worker_writes_only_its_capture_the_host_keeps_the_predictor(tmp_path: Path) -> None:
    """The host's one predictor is the authority's: a worker has no snapshot, warm start or
    shared-learning connection of its own, and its capture goes to its own folder."""
    snapshot, warm = tmp_path / "history.bin", tmp_path / "warm.jsonl"
    config = load(None, {**BACKEND, "workers": 3, "capture": {"dir": str(tmp_path / "cap")},
                         "predictor": {"snapshot_path": str(snapshot),
                                       "warm_start_jsonl": str(warm)},
                         "shared_learning": {"redis_url": "redis://r:6379",
                                             "replica_id": "gw-a"}}, {})  # fmt: skip
    zero, two = worker_config(config, 0), worker_config(config, 2)
    for worker in (zero, two):
        assert worker.predictor.snapshot_path is None
        assert worker.predictor.warm_start_jsonl is None
        assert worker.shared_learning.redis_url is None
    assert config.predictor.snapshot_path == str(snapshot)  # the authority's, unchanged
    assert not list(tmp_path.glob("history.bin*"))  # nothing copied for the workers
    assert (zero.capture.dir, two.capture.dir) == (str(tmp_path / "cap" / "worker-0"),
                                                   str(tmp_path / "cap" / "worker-2"))  # fmt: skip
    assert worker_config(load(None, BACKEND, {}), 1).capture.dir is None
