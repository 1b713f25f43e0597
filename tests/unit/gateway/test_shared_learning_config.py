"""Shared learning's config: off by default; YAML, SAGESCHED_REDIS_URL / SAGESCHED_REPLICA_ID
and --redis-url / --replica-id set it; bad values name the key; the password is masked."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import build_parser, overrides
from gateway.config import ConfigError, as_dict, build, load

BASE = {"backends": [{"url": "http://x:1"}]}


def test_off_by_default() -> None:
    shared = build(BASE).shared_learning
    assert shared.redis_url is None and shared.encoding == "int8" and shared.maxlen == 100_000


def test_yaml_then_env_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(
        "backends:\n  - url: http://a:8000\nshared_learning:\n  redis_url: redis://file:6379/0\n"
        "  stream: team:learning\n  maxlen: 5000\n"
    )
    env = {"SAGESCHED_REDIS_URL": "redis://env:6379/1", "SAGESCHED_REPLICA_ID": "gw-env"}
    shared = load(str(path), {}, env).shared_learning
    # the environment overrides its keys and keeps the file's others
    assert (shared.redis_url, shared.replica_id) == ("redis://env:6379/1", "gw-env")
    assert (shared.stream, shared.maxlen) == ("team:learning", 5000)
    args = build_parser("serve").parse_args(
        ["--redis-url", "redis://flag:6379/2", "--replica-id", "gw-flag"]
    )
    shared = load(str(path), overrides(args), env).shared_learning
    assert (shared.redis_url, shared.replica_id) == ("redis://flag:6379/2", "gw-flag")
    # a flag sets its key only: the replica id from the environment survives --redis-url
    args = build_parser("serve").parse_args(["--redis-url", "redis://flag:6379/2"])
    shared = load(str(path), overrides(args), env).shared_learning
    assert (shared.replica_id, shared.stream) == ("gw-env", "team:learning")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"redis_url": "localhost:6379"}, "redis_url must start with"),
        ({"redis_url": "redis://r:6379", "encoding": "float16"}, "encoding"),
        ({"redis_url": "redis://r:6379", "maxlen": 0}, "maxlen"),
        ({"redis_ur": "redis://r:6379"}, "unknown key"),
    ],
)
def test_invalid_values_name_the_key(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build({**BASE, "shared_learning": section})


def test_the_password_is_masked_in_the_logged_config() -> None:
    cfg = build({**BASE, "shared_learning": {"redis_url": "redis://:hunter2@r:6379/0"}})
    logged = as_dict(cfg)["shared_learning"]["redis_url"]
    assert "hunter2" not in logged and logged == "redis://:***@r:6379/0"
