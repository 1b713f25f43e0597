"""vLLM-named Prometheus series for the emulator (its own `CollectorRegistry` per app).

Names, labels (`model_name`, `engine`) and histogram bucket edges follow vLLM V1's
`/metrics`, so the gateway's adaptive cap and dashboards read the emulator and vLLM alike.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from loadgen.emulator.engine_loop import LoopStats

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LABELS = ("model_name", "engine")


class EmulatorMetrics:
    """The series; `observe_*` are called on the event loop by the server and engine loop."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, lv = self.registry, (model_name, "0")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", LABELS, registry=r
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=r
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            LABELS,
            registry=r,
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            LABELS,
            registry=r,
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            LABELS,
            buckets=ITERATION_TOKEN_BUCKETS,
            registry=r,
        )
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ("block_size", "num_gpu_blocks", "enable_prefix_caching"),
            registry=r,
        )
        self._cache_declared = False
        self._seen = (0, 0, 0)
        """(iterations, prompt tokens, generated tokens) already exposed."""
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=r,
        )

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Time spent in WAITING phase.", LATENCY_BUCKETS
        )
        self._lv = lv
        self._preempt_seen = 0
        self._prefix_seen = (0, 0)
        series: tuple[Gauge | Counter | Histogram, ...] = (
            self.running, self.waiting, self.kv, self.preemptions, self.prompt_tokens,
            self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue,
            self.prefix_queries, self.prefix_hits,
            self.iteration_tokens,
        )  # fmt: skip
        for m in series:  # expose every series from the start, as vLLM does
            m.labels(*lv)

    def on_stats(self, st: LoopStats) -> None:
        """After every iteration, submit and abort."""
        lv = self._lv
        self.running.labels(*lv).set(st.running)
        self.waiting.labels(*lv).set(st.waiting)
        self.kv.labels(*lv).set(st.kv_fraction)
        if st.preemptions > self._preempt_seen:
            self.preemptions.labels(*lv).inc(st.preemptions - self._preempt_seen)
            self._preempt_seen = st.preemptions
        queries, hits = self._prefix_seen
        if st.prefix_cache_queries > queries:
            self.prefix_queries.labels(*lv).inc(st.prefix_cache_queries - queries)
            self.prefix_hits.labels(*lv).inc(st.prefix_cache_hits - hits)
            self._prefix_seen = (st.prefix_cache_queries, st.prefix_cache_hits)
        if not self._cache_declared and st.kv_blocks:
            caching = str(st.prefix_caching)
            self.cache_config.labels(str(st.block_tokens), str(st.kv_blocks), caching).set(1)
            self._cache_declared = True
        iterations, prompt, generated = self._seen
        if st.prompt_tokens > prompt:
            self.prompt_tokens.labels(*lv).inc(st.prompt_tokens - prompt)
        steps = st.iterations - iterations
        if steps > 0:
            # one observation per iteration, each the iteration's mean tokens (a step of the
            # engine model can cover several identical decode iterations)
            per = (st.prompt_tokens - prompt + st.generated_tokens - generated) / steps
            hist = self.iteration_tokens.labels(*lv)
            for _ in range(steps):
                hist.observe(per)
        self._seen = (st.iterations, max(st.prompt_tokens, prompt), st.generated_tokens)

    def on_tokens(self, n: int, first_delay_s: float | None, gap_s: float | None) -> None:
        """`n` new tokens; the first-token delay or the gap since the previous tokens."""
        lv = self._lv
        self.generation_tokens.labels(*lv).inc(n)
        if first_delay_s is not None:
            self.ttft.labels(*lv).observe(first_delay_s)
            n -= 1
        if gap_s is not None and n > 0:
            # several tokens of one request in one delivery: the gap split evenly between them
            for _ in range(n):
                self.itl.labels(*lv).observe(gap_s / n)

    def on_finish(self, e2e_s: float, queue_s: float | None, reason: str) -> None:
        lv = self._lv
        self.e2e.labels(*lv).observe(e2e_s)
        if queue_s is not None:
            self.queue.labels(*lv).observe(queue_s)
        self.success.labels(*lv, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
