"""`sagesched routers`: print the router catalog."""

from __future__ import annotations

import argparse
import json

from policies.routing.registry import router_catalog


def main(argv: list[str], prog: str = "sagesched routers") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="List the routers (where a job goes).")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--params", action="store_true", help="also list each router's parameters")
    args = parser.parse_args(argv)
    rows = router_catalog()
    if args.json:
        out = [
            {
                "name": r.name,
                "description": r.description,
                "uses_prefix": r.uses_prefix,
                "params": {n: {"default": d, "help": h} for n, d, h in r.params},
            }
            for r in rows
        ]
        print(json.dumps(out, indent=2))
        return 0
    width = max(len(r.name) for r in rows)
    print(f"{'name':<{width}}  {'prefix':<6}  description")
    for r in rows:
        print(f"{r.name:<{width}}  {'yes' if r.uses_prefix else 'no':<6}  {r.description}")
        if args.params:
            for n, d, h in r.params:
                print(f"{'':<{width}}    {n} = {d!r}: {h}")
    return 0
