"""The C allocator's side of the gateway's memory (glibc; no-ops elsewhere).

Measured in the mixed soak (docs/reliability.md, "The SageSched soak's RSS"): with the
predictor on the path the process's RSS levelled off ~15 MB higher and later under glibc's
default arenas than with 2, and each periodic predictor snapshot left its temporary buffers
(~18 MB for a 4,096-item history) in the heap as RSS until the process ended.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

MALLOC_ARENAS = 2
"""glibc's malloc arenas in a served process (its default is 8 per core): each new thread
that allocates gets one of its own until then, and the predictor's threads (embedding,
history index, learning) fragment theirs. The event loop and a few worker threads need no
more than 2."""
_M_ARENA_MAX = -8  # mallopt's parameter number (glibc's malloc.h)


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas for this process, unless `MALLOC_ARENA_MAX` is set (the
    operator's choice wins). Call it before threads start; a no-op (False) off glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, arenas))


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system (`malloc_trim`), e.g. after a large
    temporary allocation such as a snapshot save; a few milliseconds. True when pages were
    given back (False too off glibc)."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


@cache
def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # musl, macOS
        return None
