"""The `sagesched` console script: a thin dispatcher over the four packages.

Each subcommand lives in its package's `cli` module and is imported only when asked for, so
`sagesched policies` never loads torch or aiohttp.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "policies": ("policies.cli", "list the scheduling policy catalog"),
    "routers": ("policies.routing.cli", "list the routers: which backend a job goes to"),
    "serve": ("gateway.cli", "run the scheduling gateway in front of OpenAI-compatible backends"),
    "simulate": ("loadgen.sim.cli", "simulate policies on trace windows in virtual time"),
    "traces": ("loadgen.traces.cli", "list trace sources, frozen windows and their knees"),
    "predictor": ("predictor.cli", "build, evaluate and warm the output-length predictor"),
    "study": ("loadgen.study.cli", "portability study and SageSched evaluation in simulation"),
    "emulate": ("loadgen.emulator.cli", "run an emulated vLLM backend driven by the engine model"),
    "replay": ("loadgen.replay.cli", "replay a trace open-loop against a live server"),
    "compare": ("loadgen.replay.compare", "replay the same window against several targets"),
    "demo": ("loadgen.demo", "FCFS vs SageSched on an emulated backend, no GPU needed"),
}


def _usage() -> str:
    lines = ["usage: sagesched COMMAND [options]", "", "commands:"]
    width = max(len(c) for c in COMMANDS)
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `sagesched COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"sagesched: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    result: int = module.main(rest, prog=f"sagesched {name}")
    return result


if __name__ == "__main__":
    sys.exit(main())
