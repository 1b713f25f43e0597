"""How the vLLM CPU build's executor changes what a client measures, side by side in one run.

For each executor (`mp`: the CPU build's default, the model worker in its own process; `uni`:
the worker inside the engine-core process, as `loadgen.vllm_real` starts it) this starts the
real server, warms it up, replays the same seeded window (30 requests at 2/s, fresh prompts
per replay) `--replays` times, and reads vLLM's own TTFT histogram around each replay. The
table shows the client's median and mean TTFT next to vLLM's mean TTFT: where the client sees
much more than vLLM reports, the time went to the API server and the client waiting for CPU.

Run: `python bench/vllm_executor.py [--replays 4]` (about 4 minutes; needs `make vllm-env`).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import urllib.request

from loadgen.replay import replay_window, synthetic_window
from loadgen.vllm_real import RealVllm

WINDOW = {"n": 30, "rate_per_s": 2.0, "seed": 4}
TTFT = re.compile(r"^vllm:time_to_first_token_seconds_(sum|count)\{[^}]*\} (\S+)", re.M)


def vllm_ttft(url: str) -> tuple[float, float]:
    """vLLM's own TTFT histogram: (sum, count)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    got = {m.group(1): float(m.group(2)) for m in TTFT.finditer(text)}
    return got.get("sum", 0.0), got.get("count", 0.0)


async def one_executor(executor: str, replays: int) -> list[dict[str, float]]:
    rows = []
    with RealVllm(executor=executor) as server:
        window = synthetic_window(**WINDOW)
        warm_up = synthetic_window(n=24, rate_per_s=4.0, seed=98)
        await replay_window(server.url, server.name, warm_up, seed=98)
        for i in range(replays):
            s0, c0 = vllm_ttft(server.url)
            results = await replay_window(server.url, server.name, window, seed=50 + i)
            s1, c1 = vllm_ttft(server.url)
            ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
            rows.append({
                "client_median_ttft_s": statistics.median(ttfts),
                "client_mean_ttft_s": statistics.mean(ttfts),
                "vllm_mean_ttft_s": (s1 - s0) / max(c1 - c0, 1.0),
            })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replays", type=int, default=4)
    args = ap.parse_args()
    table = {ex: asyncio.run(one_executor(ex, args.replays)) for ex in ("mp", "uni")}
    print(f"{'executor':<9}{'replay':>7}{'client p50 TTFT':>17}{'client mean':>13}"
          f"{'vLLM mean':>11}{'client/vLLM':>13}")  # fmt: skip
    for ex, rows in table.items():
        for i, r in enumerate(rows):
            ratio = r["client_mean_ttft_s"] / r["vllm_mean_ttft_s"]
            ms = {k: v * 1000 for k, v in r.items()}
            print(f"{ex:<9}{i:>7}{ms['client_median_ttft_s']:>14.1f} ms"
                  f"{ms['client_mean_ttft_s']:>10.1f} ms{ms['vllm_mean_ttft_s']:>8.1f} ms"
                  f"{ratio:>13.2f}")  # fmt: skip
    mp, uni = (statistics.median(r["client_mean_ttft_s"] for r in table[e]) for e in ("mp", "uni"))
    print(f"median client mean TTFT, mp / uni: {mp / uni:.2f}")


if __name__ == "__main__":
    main()
