"""`sagesched serve`: run the gateway.

Configuration comes from an optional YAML file, then SAGESCHED_* environment variables, then
these flags (`gateway.config`). `--backend URL` may be repeated; the flags describe those
backends fully, so no file is needed for a simple deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from gateway.config import ConfigError, GatewayConfig, load
from gateway.serving.drain import KeySource


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run the SageSched scheduling gateway.")
    p.add_argument("--config", help="YAML config file")
    p.add_argument(
        "--backend", action="append", metavar="URL", help="backend base URL (repeatable)"
    )
    p.add_argument("--max-inflight", type=int, help="in-flight cap for each --backend (default 8)")
    p.add_argument("--backend-priority", action="store_true", default=None,
                   help="the --backend servers run vLLM --scheduling-policy priority")  # fmt: skip
    p.add_argument(
        "--policy", help="policy spec, e.g. sagesched or fcfs (see `sagesched policies`)"
    )
    p.add_argument("--routing", help="router spec: which backend a job goes to, e.g. sagesched "
                   "(the default), prefix or least-loaded (see `sagesched routers`)")  # fmt: skip
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8080)")
    p.add_argument("--workers", type=int,
                   help="relay processes sharing the port, one scheduling queue per host "
                   "(default 1: one process)")  # fmt: skip
    p.add_argument("--admin-key", help="bearer token for /admin routes")
    p.add_argument("--admin-listen", metavar="HOST:PORT",
                   help="serve /admin routes only on this address")  # fmt: skip
    p.add_argument("--api-key", action="append", help="accepted client API key (repeatable)")
    p.add_argument("--shutdown-grace", type=float, dest="shutdown_grace_s", metavar="SECONDS",
                   help="on SIGTERM, seconds in-flight requests get to finish "
                   "(default 30)")  # fmt: skip
    p.add_argument("--max-waiting", type=int, help="queue bound (429 beyond)")
    p.add_argument("--queue-timeout", type=float, dest="queue_timeout_s", help="seconds before 503")
    p.add_argument("--preemption", action="store_true", default=None, help="allow preemption")
    p.add_argument("--forward-priority", action=argparse.BooleanOptionalAction, default=None,
                   help="send the policy key as vLLM priority (default on)")  # fmt: skip
    p.add_argument("--adaptive-cap", action=argparse.BooleanOptionalAction, default=None,
                   help="tune each backend's cap from its vLLM metrics (default on; "
                   "--no-adaptive-cap: --max-inflight is fixed)")  # fmt: skip
    p.add_argument("--predictor-snapshot", help="load/save the predictor history here")
    p.add_argument("--capture", metavar="DIR",
                   help="record every request's counts and times (never text) to DIR")  # fmt: skip
    p.add_argument("--capture-embeddings", action="store_true",
                   help="with --capture: also the prompts' embeddings (sensitive)")  # fmt: skip
    p.add_argument("--redis-url", help="share learned completions with the other replicas "
                   "through this Redis (redis://host:6379/0)")  # fmt: skip
    p.add_argument("--replica-id", help="this replica's name in the shared records")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    return p


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Flags as config keys (None = not given)."""
    out: dict[str, Any] = {
        k: getattr(args, k)
        for k in (
            "policy",
            "routing",
            "host",
            "port",
            "workers",
            "admin_key",
            "admin_listen",
            "max_waiting",
            "queue_timeout_s",
            "preemption",
            "forward_priority",
            "log_level",
            "shutdown_grace_s",
        )
    }
    if args.api_key:
        out["api_keys"] = args.api_key
    if args.backend:
        out["backends"] = [
            {
                "url": url,
                "max_inflight": args.max_inflight or 8,
                "priority_scheduling": bool(args.backend_priority),
            }
            for url in args.backend
        ]
    if args.adaptive_cap is not None:
        out["adaptive_cap"] = {"enabled": args.adaptive_cap}
    if args.capture_embeddings and not args.capture:
        raise ConfigError("--capture-embeddings needs --capture DIR")
    if args.capture:
        out["capture"] = {"dir": args.capture, "embeddings": bool(args.capture_embeddings)}
    if args.predictor_snapshot:
        out["predictor"] = {"snapshot_path": args.predictor_snapshot}
    if args.redis_url or args.replica_id:
        shared = {"redis_url": args.redis_url, "replica_id": args.replica_id}
        out["shared_learning"] = {k: v for k, v in shared.items() if v}
    return out


def serve(config: GatewayConfig, source: KeySource | None = None) -> int:
    """Run until SIGINT/SIGTERM, then drain: the listener closes, the requests in flight get
    `shutdown_grace_s`, the rest are ended cleanly, the predictor snapshot is saved, exit 0
    (`gateway.serving.drain`, `gateway.serving.server`). SIGHUP re-reads the keys from `source`. On
    uvloop when it is installed. With `workers` > 1: worker processes and one scheduling authority
    (`gateway.workers.supervisor`). Returns the exit status."""
    from gateway.workers import supervisor as workers

    if config.workers > 1:
        return workers.serve(config, source)
    with workers.event_loop() as runner:
        runner.run(_serve_one(config, source))
    return 0


async def _serve_one(config: GatewayConfig, source: KeySource | None) -> None:
    from gateway.serving.app import KEY_SOURCE, create_app
    from gateway.serving.server import serve_until, stop_on_signals

    log = logging.getLogger("sagesched.gateway")
    stop = asyncio.Event()
    stop_on_signals(stop)
    app = create_app(config)
    if source is not None:
        app[KEY_SOURCE] = source
    await serve_until(
        app, config, stop,
        ready=lambda: log.info("listening on http://%s:%d", config.host, config.port),
    )  # fmt: skip


def main(argv: list[str], prog: str = "sagesched serve") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        source = KeySource(args.config, overrides(args))
        config = load(source.path, source.overrides)
    except (ConfigError, OSError) as exc:
        print(f"{prog}: {exc}")
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve(config, source)
