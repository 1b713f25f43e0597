"""Config pipeline: file, environment, flags, validation; defaults of the cap and priority."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import build_parser, overrides
from gateway.config import ConfigError, as_dict, build, load


def test_file_env_flags_in_that_order(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(
        "policy: fcfs\nport: 9000\nbackends:\n  - url: http://a:8000\n    max_inflight: 3\n"
        "adaptive_cap:\n  enabled: true\n  kv_high: 0.8\n"
    )
    env = {"SAGESCHED_PORT": "9100", "SAGESCHED_ADMIN_KEY": "s3cret"}
    cfg = load(str(path), {"policy": "sagesched:cost=tokens", "port": None}, env)
    assert cfg.port == 9100  # env beats the file; a flag left unset (None) changes nothing
    assert cfg.policy == "sagesched:cost=tokens"  # flags beat both
    assert cfg.backends[0].max_inflight == 3 and cfg.backends[0].name == "a:8000"
    assert cfg.adaptive_cap.enabled and cfg.adaptive_cap.kv_high == 0.8
    assert as_dict(cfg)["admin_key"] == "***"


def test_env_backends_list() -> None:
    cfg = load(None, {}, {"SAGESCHED_BACKENDS": "http://a:1, http://b:2"})
    assert [b.url for b in cfg.backends] == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"backends": []}, "at least one backend"),
        ({"backends": [{"url": "a:1"}]}, "must start with http"),
        ({"backends": [{"url": "http://a"}], "portt": 1}, "unknown key"),
        ({"backends": [{"url": "http://a", "max_inflight": "many"}]}, "must be a number"),
        ({"backends": [{"url": "http://a", "colour": 1}]}, "unknown key"),
        ({"backends": [{"url": "http://a"}], "policy": "nope"}, "unknown policy"),
        ({"backends": [{"url": "http://a"}], "preemption": "maybe"}, "true or false"),
        ({"backends": [{"url": "http://a"}, {"url": "http://a"}]}, "unique"),
        ({"backends": [{"url": "http://a"}], "queue_timeout_s": 0}, "queue_timeout_s"),
        (
            {"backends": [{"url": "http://a"}], "predictor": {"embed_backend": "gpu"}},
            "predictor.embed_backend",
        ),
    ],
)
def test_invalid_configs_name_the_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(data)


def test_serve_flags_describe_backends_without_a_file() -> None:
    args = build_parser("serve").parse_args(
        ["--backend", "http://x:1", "--backend", "http://y:2", "--max-inflight", "4",
         "--policy", "fcfs", "--port", "8123", "--preemption"]
    )  # fmt: skip
    cfg = load(None, overrides(args), {})
    assert [(b.url, b.max_inflight) for b in cfg.backends] == [("http://x:1", 4), ("http://y:2", 4)]
    assert cfg.port == 8123 and cfg.preemption and cfg.policy == "fcfs"


def test_self_tuning_cap_and_priority_forwarding_are_on_by_default() -> None:
    cfg = load(None, {"backends": [{"url": "http://a:1"}]}, {})
    assert cfg.adaptive_cap.enabled and cfg.forward_priority
    args = build_parser("serve").parse_args(["--backend", "http://x:1", "--no-adaptive-cap"])
    assert not load(None, overrides(args), {}).adaptive_cap.enabled


def test_capture_is_off_by_default_and_set_by_flag_or_yaml() -> None:
    base = {"backends": [{"url": "http://x:1"}]}
    assert build(base).capture.dir is None
    args = build_parser("serve").parse_args(["--backend", "http://x:1", "--capture", "/tmp/c"])
    assert load(None, overrides(args), {}).capture.dir == "/tmp/c"
    with pytest.raises(ConfigError, match="capture"):
        build({**base, "capture": {"dir": "/tmp/c", "max_files": 0}})


def test_tracing_is_off_by_default_and_checked() -> None:
    from gateway.config import apply_env

    base = {"backends": [{"url": "http://x"}]}
    assert not build(base).tracing.enabled
    assert build(apply_env(base, {"SAGESCHED_TRACING": "true"})).tracing.enabled
    on = build({**base, "tracing": {"enabled": True, "sample_ratio": 0.01, "protocol": "grpc"}})
    assert on.tracing.sample_ratio == 0.01 and on.tracing.protocol == "grpc"
    for bad in ({"protocol": "udp"}, {"sample_ratio": 1.5}, {"max_queue": 0}):
        with pytest.raises(ConfigError, match="tracing"):
            build({**base, "tracing": bad})
