"""Shared fixtures for every test tier: the emulated backend and the real vLLM CPU build.

The fixtures live in `tests/fixtures/` (imported here as plugins) so other folders can use
them: `emulator_url` / `start_emulator` (in-process emulated vLLM) and `real_vllm` /
`real_vllm_priority` (one real vLLM CPU server per test session; slow), `start_redis` (a real
redis-server on a free port), `start_otlp_receiver` (a real OTLP/HTTP trace receiver).
"""

pytest_plugins = [
    "fixtures.emulator_fixtures",
    "fixtures.gateway_fixtures",
    "fixtures.otlp_receiver",
    "fixtures.prometheus_fixtures",
    "fixtures.real_vllm_fixtures",
    "fixtures.redis_fixtures",
    "fixtures.worker_fixtures",
]
