"""`sagesched policies`: print the policy catalog."""

from __future__ import annotations

import argparse
import json

from policies.registry import catalog


def main(argv: list[str], prog: str = "sagesched policies") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="List the scheduling policies.")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--params", action="store_true", help="also list each policy's parameters")
    args = parser.parse_args(argv)
    rows = catalog()
    if args.json:
        out = [
            {
                "name": r.name,
                "description": r.description,
                "preemptive": r.preemptive == "yes",
                "needs": r.needs,
                "params": {n: {"default": d, "help": h} for n, d, h in r.params},
            }
            for r in rows
        ]
        print(json.dumps(out, indent=2, default=list))
        return 0
    width = max(len(r.name) for r in rows)
    print(f"{'name':<{width}}  {'preempt':<7}  {'needs':<10}  description")
    for r in rows:
        print(f"{r.name:<{width}}  {r.preemptive:<7}  {r.needs:<10}  {r.description}")
        if args.params:
            for n, d, h in r.params:
                print(f"{'':<{width}}    {n} = {d!r}: {h}")
    return 0
