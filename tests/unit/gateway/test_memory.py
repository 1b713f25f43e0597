"""`gateway.prediction.memory`: a served process uses at most `MALLOC_ARENAS` glibc malloc arenas
however
many threads allocate (counted by glibc's own `malloc_stats`), and `release_free_memory`
gives freed heap pages back (RSS read from /proc). Each case runs in a fresh interpreter:
the arena cap only takes before threads start."""

from __future__ import annotations

import os
import subprocess
import sys

from gateway.prediction.memory import MALLOC_ARENAS

ARENAS = """
import ctypes, sys, threading
from gateway.prediction.memory import limit_malloc_arenas
print(limit_malloc_arenas() if sys.argv[1] == "limit" else None)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
barrier = threading.Barrier(8)

def churn():
    barrier.wait()
    for _ in range(20000):
        libc.free(libc.malloc(256))

threads = [threading.Thread(target=churn) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
sys.stdout.flush()
libc.malloc_stats()
"""

RELEASE = """
import ctypes, os
from gateway.prediction.memory import release_free_memory

def rss_kb():
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(16384) for _ in range(4000)]  # 64 MB below the mmap threshold: the heap
for b in blocks:
    ctypes.memset(b, 1, 16384)
for b in blocks[:-1]:  # the last one keeps the heap's top: nothing is trimmed on its own
    libc.free(b)
before = rss_kb()
released = release_free_memory()
print(released, before, rss_kb())
"""


def child(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
        env={**base, **env},
    )  # fmt: skip


def arenas(mode: str, **env: str) -> tuple[str, int]:
    out = child(ARENAS, mode, **env)
    return out.stdout.strip(), out.stderr.count("Arena ")


def test_a_served_process_uses_at_most_the_capped_arenas() -> None:
    said, limited = arenas("limit")
    _, free = arenas("none")
    assert said == "True"
    assert 1 <= limited <= MALLOC_ARENAS, limited
    assert free > MALLOC_ARENAS, free  # uncapped, glibc gives the threads arenas of their own


def test_the_operators_malloc_arena_max_wins() -> None:
    said, n = arenas("limit", MALLOC_ARENA_MAX="4")
    assert said == "False"
    assert MALLOC_ARENAS < n <= 4, n


def test_release_gives_freed_heap_pages_back() -> None:
    released, before, after = child(RELEASE).stdout.split()
    assert released == "True"
    assert int(before) - int(after) > 50_000, (before, after)  # of the ~64 MB freed, in kB
