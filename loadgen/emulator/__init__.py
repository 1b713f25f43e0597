"""Emulated vLLM backend: the engine model (`loadgen.engine`) in real time behind vLLM's API.

`server.create_app(EmulatorConfig(...))` builds the aiohttp app; `engine_loop` steps the
engine model in wall time; `protocol` holds the wire format and the documented deterministic
rules (prompt token count, natural output length, filler text); `metrics` the vLLM-named
series; `cli` is `sagesched emulate`. Depends on `loadgen.engine` and `policies` only.
"""

from loadgen.emulator.server import EmulatorConfig, create_app, make_runner

__all__ = ["EmulatorConfig", "create_app", "make_runner"]
