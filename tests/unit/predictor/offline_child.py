"""Child process of test_predictor_restart_offline: a fresh interpreter with the network cut.

argv: snapshot path, JSON list of prompts; or `--export` (test_predictor_onnx: the ONNX export
itself, into an empty cache). Prints one JSON line (see the tests).
"""

import json
import os
import socket
import sys

blocked = []
_connect, _getaddrinfo = socket.socket.connect, socket.getaddrinfo


def _local(host):
    return isinstance(host, str) and (host in ("localhost", "::1") or host.startswith("127."))


def connect(self, address):
    if self.family == socket.AF_UNIX or _local(address[0]):
        return _connect(self, address)
    blocked.append(f"connect {address!r}")
    raise OSError("network disabled by test")


def connect_ex(self, address):
    connect(self, address)
    return 0


def getaddrinfo(host, *args, **kwargs):
    if host is None or _local(host):
        return _getaddrinfo(host, *args, **kwargs)
    blocked.append(f"getaddrinfo {host!r}")
    raise socket.gaierror("network disabled by test")


socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
socket.getaddrinfo = getaddrinfo
try:  # the guard itself must work
    socket.create_connection(("192.0.2.1", 80), timeout=1)
    guard_ok = False
except OSError:
    guard_ok = bool(blocked)
blocked.clear()

if sys.argv[1] == "--export":  # argv: --export. $SAGESCHED_CACHE_DIR is empty: export, embed
    from predictor import Embedder
    from predictor.onnx_export import default_cache_dir

    embedder = Embedder(device="cpu", torch_threads=1)  # the default backend, ONNX int8
    vec = embedder.encode(["hello world"])[0]
    files = sorted(p.name for p in default_cache_dir().rglob("*"))
    report = {"blocked": blocked, "guard_ok": guard_ok, "files": files, "backend": embedder.backend}
    print(json.dumps(report | {"norm": float(sum(float(x) ** 2 for x in vec) ** 0.5)}))
    sys.exit(0)

from predictor import LengthPredictor, load_tokenizer  # noqa: E402 - after the guard, on purpose

model = LengthPredictor.load(sys.argv[1])
prompts = json.loads(sys.argv[2])
dists = [model.predict(p, prompt_tokens=10) for p in prompts]
out = [[d.support.tolist(), d.probs.tolist()] for d in dists]
ntok = len(load_tokenizer()("hello world", add_special_tokens=False)["input_ids"])
report = {"dists": out, "blocked": blocked, "guard_ok": guard_ok, "items": len(model.index)}
report |= {"offline": os.environ.get("HF_HUB_OFFLINE"), "ntok": ntok}
report |= {"backend": model.embedder.backend, "torch": "torch" in sys.modules}
print(json.dumps(report))
