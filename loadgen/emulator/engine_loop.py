"""Real-time driver of the engine model (`loadgen.engine`): the emulator's "GPU".

One asyncio task runs the engine one iteration at a time. Each iteration is planned with
`Engine.step(now, 0)` (a zero horizon means exactly one iteration), then the task sleeps the
iteration's profile time × `time_scale` and only then makes the iteration's tokens visible:
a request's `emitted` counter rises and its `event` is set. Handlers wait on that event and
stream what is new, so no per-token queue exists (memory per request is bounded by design).

Clocks: the engine runs in virtual seconds `v = (loop.time() − t0) / time_scale`; with
`time_scale = 0.1` the emulator runs ten times faster than the profile says. All methods are
called on the event loop thread; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from loadgen.engine.configs import EngineConfig
from loadgen.engine.model import Engine, Seq
from loadgen.engine.profiles import LatencyProfile
from policies.job import Job


@dataclass(slots=True, eq=False)
class EmuRequest:
    """One request inside the emulated engine (wall times from `loop.time()`)."""

    seq: Seq
    arrival_w: float
    event: asyncio.Event = field(default_factory=asyncio.Event)
    """Set whenever `emitted` rises or the request ends; the consumer clears it."""
    emitted: int = 0
    """Output tokens made visible so far (iterations that have ended)."""
    done: bool = False
    aborted: bool = False
    scheduled_w: float | None = None
    """When the engine first admitted it (end of queue time)."""
    first_token_w: float | None = None
    last_token_w: float | None = None
    pending: asyncio.TimerHandle | None = None
    """Set while the request is still on its way to the engine (request overhead)."""

    @property
    def output_tokens(self) -> int:
        return self.seq.output

    @property
    def prompt_tokens(self) -> int:
        return self.seq.prompt


@dataclass(slots=True)
class LoopStats:
    """What `/metrics` reads after every iteration."""

    running: int = 0
    waiting: int = 0
    kv_fraction: float = 0.0
    preemptions: int = 0
    iterations: int = 0
    prompt_tokens: int = 0
    """Prompt (and recompute) tokens prefilled so far."""
    generated_tokens: int = 0
    block_tokens: int = 16
    kv_blocks: int = 0
    """The KV cache's block size and block count (vLLM's `cache_config_info`)."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache (vLLM's counter)."""
    prefix_cache_hits: int = 0
    """Of those, tokens found cached."""
    prefix_caching: bool = False
    """Whether the engine caches prefixes (`cache_config_info`'s `enable_prefix_caching`)."""


MAX_LAG_S = 0.05
"""How far behind its schedule the engine loop may run before it resets to the wall clock."""

TokenHook = Callable[[EmuRequest, int, float], None]
"""Called with (request, new tokens, wall time) when an iteration's tokens become visible."""


class EngineLoop:
    """Owns one `Engine` and the task that steps it in real time."""

    def __init__(
        self,
        config: EngineConfig,
        profile: LatencyProfile,
        *,
        time_scale: float = 1.0,
        on_tokens: TokenHook | None = None,
        on_iteration: Callable[[LoopStats], None] | None = None,
    ) -> None:
        if not time_scale > 0:
            raise ValueError("time_scale must be positive")
        self.engine = Engine(config, profile)
        self.time_scale = time_scale
        self.stats = LoopStats()
        self._on_tokens = on_tokens
        self._on_iteration = on_iteration
        self._active: dict[int, EmuRequest] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the stepping task (once)."""
        loop = asyncio.get_running_loop()
        self._t0 = loop.time()
        self._task = asyncio.create_task(self._run(), name="emulator-engine")

    async def stop(self) -> None:
        """Cancel the stepping task and end every request (their consumers see `done`)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in list(self._active.values()):
            self._end(req)

    # -- requests -------------------------------------------------------------------------------

    def virtual_now(self) -> float:
        """Engine clock in virtual seconds."""
        return (asyncio.get_running_loop().time() - self._t0) / self.time_scale

    def submit(
        self,
        prompt_tokens: int,
        output_tokens: int,
        priority: int = 0,
        *,
        event: asyncio.Event | None = None,
        hashes: tuple[int, ...] = (),
    ) -> EmuRequest:
        """Queue a request that will produce exactly `output_tokens` tokens (≥ 1). It reaches
        the engine after the profile's `request_overhead_s` (× time scale). Sequences of one
        response (`n` > 1, a batch of prompts) share one `event`, so one waiter sees them all.
        `hashes`: the prompt's block-hash chain in the engine's block size (prefix cache)."""
        loop = asyncio.get_running_loop()
        job = Job(next(self._ids), self.virtual_now(), max(1, prompt_tokens), priority=priority)
        job.max_tokens = output_tokens
        out = max(1, output_tokens)
        block = self.engine.cfg.block_tokens if hashes else 0
        req = EmuRequest(Seq(job, out, float(out), hashes=hashes, hash_tokens=block), loop.time())
        if event is not None:
            req.event = event
        job.ctx = req
        self._active[job.id] = req
        n_running = len(self.engine.running)
        delay = self.engine.profile.request_overhead_s(n_running) * self.time_scale
        if delay > 0:
            req.pending = loop.call_later(delay, self._enter, req)
        else:
            self._enter(req)
        return req

    def _enter(self, req: EmuRequest) -> None:
        req.pending = None
        if req.done:
            return
        req.seq.job.arrival_s = self.virtual_now()
        self.engine.add(req.seq)
        self._publish()
        self._wake.set()

    def abort(self, req: EmuRequest) -> None:
        """Client gone: take the request out of the engine now (idempotent)."""
        if req.done:
            return
        req.aborted = True
        if req.pending is not None:
            req.pending.cancel()
        eng = self.engine
        if req.seq in eng.running or req.seq in eng.waiting:
            eng.abort(req.seq)
        self._end(req)
        self._publish()

    def _end(self, req: EmuRequest) -> None:
        req.done = True
        self._active.pop(req.seq.job.id, None)
        req.event.set()

    # -- the loop ---------------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        end_w: float | None = None  # scheduled end of the previous iteration while busy
        while True:
            if not len(self.engine):
                end_w = None
                self._wake.clear()
                await self._wake.wait()
                continue
            now_w = loop.time()
            # back to back: the next iteration starts when the last one was due to end, so a
            # late wake-up (busy CPU) does not stretch the schedule; beyond MAX_LAG_S behind,
            # the engine gives up catching up
            start_w = now_w if end_w is None or now_w - end_w > MAX_LAG_S else end_w
            result = self.engine.step((start_w - self._t0) / self.time_scale, 0.0)
            self._mark_scheduled(now_w)
            end_w = start_w + result.dt_s * self.time_scale
            # sleep(0) still yields, so arrivals and aborts interleave with fast iterations
            await asyncio.sleep(max(0.0, end_w - loop.time()))
            self._deliver(loop.time(), result.finished + result.dropped)

    def _mark_scheduled(self, now_w: float) -> None:
        for seq in self.engine.running:
            req: EmuRequest = seq.job.ctx
            if req.scheduled_w is None:
                req.scheduled_w = now_w

    def _deliver(self, now_w: float, ended: list[Seq]) -> None:
        for req in list(self._active.values()):
            new = req.seq.generated - req.emitted
            if new > 0:
                if self._on_tokens is not None:  # before the timestamps move: it reads them
                    self._on_tokens(req, new, now_w)
                req.emitted = req.seq.generated
                if req.first_token_w is None:
                    req.first_token_w = now_w
                req.last_token_w = now_w
                req.event.set()
        for seq in ended:
            req = seq.job.ctx
            if not req.done:
                self._end(req)
        self._publish()

    def _publish(self) -> None:
        eng, st = self.engine, self.stats
        st.running, st.waiting = len(eng.running), len(eng.waiting)
        st.kv_fraction = eng.kv_fraction() if not math.isnan(eng.kv_fraction()) else 0.0
        st.preemptions, st.iterations = eng.preemptions, eng.iterations
        st.prompt_tokens, st.generated_tokens = eng.prompt_tokens, eng.generated_tokens
        st.block_tokens, st.kv_blocks = eng.cfg.block_tokens, eng.cfg.kv_blocks
        st.prefix_cache_queries, st.prefix_cache_hits = (
            eng.prefix_cache_queries,
            eng.prefix_cache_hits,
        )
        st.prefix_caching = eng.cache is not None
        if self._on_iteration is not None:
            self._on_iteration(st)
