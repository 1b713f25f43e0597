"""Child servers for the demo, the validation scripts, the benchmarks and the test fixtures,
always cleaned up.

Each child runs in its own session (process group) so that stopping it stops everything it
started (`stop_group`: SIGTERM, then SIGKILL after a grace period); `Children` is a context
manager that stops all of them however the block ends, including on KeyboardInterrupt.
`wait_http` waits for a child's readiness URL; `free_port` picks a port for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(
    url: str,
    timeout_s: float,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    """Poll `url` until it answers 200; raise RuntimeError on timeout or if `proc` exits (with
    the end of `log`, the child's output, when given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = f":\n{log.read_text(errors='replace')[-3000:]}" if log else ""
            raise RuntimeError(
                f"{proc.args!r} exited with {proc.returncode} before {url} was up{tail}"
            )
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not up after {timeout_s:.0f} s" + (f" (log: {log})" if log else ""))


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM to the child's process group, SIGKILL after `grace_s`, then SIGKILL to any
    stragglers left in its group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def sagesched(*args: str) -> list[str]:
    """The command line of `sagesched ARGS` with this interpreter."""
    return [sys.executable, "-m", "sagesched_cli", *args]


class Children:
    """Started child processes; all stopped on exit from the `with` block."""

    def __init__(self, log_dir: Path, grace_s: float = 10.0) -> None:
        self.log_dir = log_dir
        self.grace_s = grace_s
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, cmd: list[str], ready_url: str, timeout_s: float = 120.0,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
        """Start `cmd` (output to `<log_dir>/<name>.log`) and wait until `ready_url` answers."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **(env or {})},
            )  # fmt: skip
        self.procs.append(proc)
        wait_http(ready_url, timeout_s, proc, log_path)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """`stop_group` with this set's grace period."""
        stop_group(proc, self.grace_s)
        if proc in self.procs:
            self.procs.remove(proc)

    def __enter__(self) -> Children:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)
