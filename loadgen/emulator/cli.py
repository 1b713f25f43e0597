"""`sagesched emulate`: serve an emulated vLLM backend driven by the engine model."""

from __future__ import annotations

import argparse

from aiohttp import web

from loadgen.emulator.server import EmulatorConfig, create_app
from loadgen.engine.configs import engine_names
from loadgen.engine.profiles import profile_names


def build_parser(prog: str) -> argparse.ArgumentParser:
    d = EmulatorConfig()
    ap = argparse.ArgumentParser(prog=prog, description=__doc__)
    ap.add_argument("--profile", default=d.profile, choices=profile_names())
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--served-model-name", "--model", dest="model", default=d.model)
    ap.add_argument(
        "--time-scale", type=float, default=d.time_scale,
        help="wall seconds per profile second (0.1: ten times faster)",
    )  # fmt: skip
    ap.add_argument("--max-model-len", type=int, default=d.max_model_len)
    ap.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    ap.add_argument(
        "--reject-priority", action="store_true",
        help="reject a non-zero priority without priority scheduling (vLLM < 0.32)",
    )  # fmt: skip
    ap.add_argument("--engine", default=d.engine, choices=engine_names())
    ap.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    ap.add_argument("--kv-tokens", type=int, default=d.kv_tokens)
    ap.add_argument("--block-size", type=int, default=d.block_size, help="KV block tokens")
    ap.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction,
        default=d.prefix_caching, help="automatic prefix caching (vLLM V1's default: on)",
    )  # fmt: skip
    ap.add_argument("--kv-events-config", metavar="JSON",
                    help="publish KV-cache events as vLLM does, e.g. "
                    '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                    '"endpoint": "tcp://*:5557"}\'')  # fmt: skip
    return ap


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    return EmulatorConfig(
        profile=args.profile,
        model=args.model,
        time_scale=args.time_scale,
        max_model_len=args.max_model_len,
        priority_scheduling=args.scheduling_policy == "priority",
        reject_priority=args.reject_priority,
        engine=args.engine,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_tokens=args.kv_tokens,
        block_size=args.block_size,
        prefix_caching=args.enable_prefix_caching,
        kv_events=args.kv_events_config,
    )


def serve(config: EmulatorConfig, host: str, port: int) -> None:
    """Run until SIGINT/SIGTERM (aiohttp's `run_app`; port 0: a free one, printed)."""

    def ready(message: str) -> None:
        where = message.strip().splitlines()[0].strip("= ")  # "Running on http://host:port"
        print(f"emulating vLLM ({config.profile}, model {config.model}): {where}", flush=True)

    web.run_app(create_app(config), host=host, port=port, handler_cancellation=True,
                access_log=None, print=ready)  # fmt: skip


def main(argv: list[str], prog: str = "sagesched emulate") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        config = config_from_args(args)
        config.engine_config()
    except ValueError as e:
        print(f"{prog}: {e}")
        return 2
    serve(config, args.host, args.port)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:], "python -m loadgen.emulator.cli"))
