"""Child servers for the demo and the validation scripts, always cleaned up.

Each child runs in its own session (process group) so that stopping it stops everything it
started; `Children` is a context manager that stops all of them (SIGTERM, then SIGKILL after a
grace period) however the block ends, including on KeyboardInterrupt.
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


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll `url` until it answers 200; raise RuntimeError on timeout or if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before {url} was up")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not up after {timeout_s:.0f} s")


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
        with (self.log_dir / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **(env or {})},
            )  # fmt: skip
        self.procs.append(proc)
        wait_http(ready_url, timeout_s, proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGTERM to the child's process group, SIGKILL after the grace period."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError):  # stragglers in its group
            os.killpg(proc.pid, signal.SIGKILL)
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
