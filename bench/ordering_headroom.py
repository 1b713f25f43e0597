"""How much can *any* queue order gain on a workload? The exact-length bound beside SageSched.

For each workload and utilisation this runs, on the memory regime of the SageSched study
(`h200-qwen3-32b` profile and engine, the gateway cap at 90% of the KV-held batch), FCFS, the
non-preemptive exact-length order (`sjf-oracle`: shortest true output first, the best a
non-preemptive length order can do), SSJF and SageSched with exact lengths (oracle-0%), and
prints mean TTLT and the gain over FCFS with the workload's coefficient of variation of output
lengths. Ordering by length helps in proportion to how different the lengths are; when even
the exact order gains less than a target, no predictor can reach it on that workload.

    python bench/ordering_headroom.py [--requests 2000] [--seeds 2]

Workloads: `docwriting` (whole ShareGPT conversations, `predictor.datasets.document_pairs`) and
`docwriting+chat` (the same, with one ShareGPT first-turn chat request per document request:
a service that writes documents and answers chat, the length mix of a general deployment).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.metrics import summarize
from loadgen.sim.simulator import simulate
from loadgen.study import sagesched_eval as ev

POLICIES = ("fcfs", "sjf-oracle", "ssjf", "sagesched")


def workload(name: str, n: int, seed: int) -> list:
    _, docs = ev.text_split("docwriting", 3000, 3000, 0)
    records = list(docs)
    if name == "docwriting+chat":
        _, chat = ev.text_split("sharegpt", 3000, 1000, 0)
        records = records[: len(chat)] + list(chat)
    _, reqs = ev._poisson(records, n, np.random.default_rng([seed, 99]))
    return reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--utils", default="1.0,1.2,1.5")
    args = ap.parse_args()
    print(
        "| workload | util | CV(output) | FCFS s | "
        + " | ".join(f"{p} gain" for p in POLICIES[1:])
        + " |"
    )
    print("|---|---|---|---|" + "---|" * (len(POLICIES) - 1))
    for name in ("docwriting", "docwriting+chat"):
        for util in (float(u) for u in args.utils.split(",")):
            ttlt: dict[str, list[float]] = {p: [] for p in POLICIES}
            cvs = []
            for seed in range(args.seeds):
                base = workload(name, args.requests, seed)
                out = np.array([r.output_tokens for r in base], dtype=float)
                cvs.append(out.std() / out.mean())
                reqs = ev._at_util(base, util, ev.MEMORY)
                for p in POLICIES:
                    c = ev.contender(p, ev.MEMORY, reqs)
                    res = simulate(reqs, c, ev.MEMORY.profile, belief_sigma=0.0)
                    ttlt[p].append(summarize(res.records)["ttlt_s_mean"])
            fcfs = np.array(ttlt["fcfs"])
            gains = [
                f"{100 * float(np.mean(1 - np.array(ttlt[p]) / fcfs)):+.1f}%" for p in POLICIES[1:]
            ]
            print(
                f"| {name} | {util} | {np.mean(cvs):.2f} | {fcfs.mean():.1f} | "
                + " | ".join(gains)
                + " |",
                flush=True,
            )


if __name__ == "__main__":
    main()
