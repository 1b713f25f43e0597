"""`sagesched serve --backend URL --policy NAME --port N` works without a config file, next to
`sagesched emulate`, as separate processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from loadgen.vllm_real import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@contextmanager
def cli(*args: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-m", "sagesched_cli", *args], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # a clean, graceful exit on SIGTERM


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def wait_status(url: str, want: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while status(url) != want:
        assert time.monotonic() < deadline, f"{url} never answered {want}"
        time.sleep(0.1)


def test_serve_and_emulate_processes() -> None:
    backend, gateway = free_port(), free_port()
    with cli("serve", "--backend", f"http://127.0.0.1:{backend}", "--policy", "fcfs",
             "--port", str(gateway)):  # fmt: skip
        wait_status(f"http://127.0.0.1:{gateway}/health", 200)
        assert status(f"http://127.0.0.1:{gateway}/ready") == 503  # no backend yet
        with cli("emulate", "--profile", "cpu-tiny-vllm", "--port", str(backend)):
            wait_status(f"http://127.0.0.1:{gateway}/ready", 200)
            import openai

            client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="x")
            with client:
                r = client.chat.completions.create(
                    model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3
                )
            assert r.choices[0].message.content
