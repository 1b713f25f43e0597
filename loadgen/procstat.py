"""What a child server uses, read from `/proc` (Linux): resident memory, open file descriptors
and CPU time. The load tests and the soak (`bench/soak.py`) sample a real `sagesched serve`
process with these, so the figures are the kernel's, not the process's own view of itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def rss_kb(pid: int) -> int:
    """Resident set size of `pid` in KiB (`VmRSS` of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def fd_count(pid: int) -> int:
    """Open file descriptors of `pid` (entries of /proc/PID/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds `pid` has used (fields 14 and 15 of /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICKS


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of a process."""

    rss_kb: int
    fds: int
    cpu_s: float


def sample(pid: int) -> Sample:
    return Sample(rss_kb(pid), fd_count(pid), cpu_s(pid))


def socket_remote_ports(pid: int) -> list[int]:
    """The remote port of each TCP socket `pid` holds open (0 for a listening socket), from
    /proc/PID/net/tcp{,6} matched to its descriptors by inode."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.append(int(fields[2].rsplit(":", 1)[1], 16))
    return ports
