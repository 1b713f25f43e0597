# Two entry points for a fresh machine (see README): `make test` and `make demo`.
# Everything installs into .venv; torch comes first as the CPU build so that
# sentence-transformers does not pull a CUDA wheel.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-fast demo docs lint typecheck unit timing bench-policies clean vllm-env system-deps lock soak

# Versions are pinned by requirements.lock (constraints: only what pyproject.toml asks for is
# installed, at the locked version); `make lock` refreshes it from the venv.
LOCK := requirements.lock

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c $(LOCK) torch==2.13.0
	$(BIN)/pip install --quiet -c $(LOCK) -e '.[dev]'
	$(BIN)/python -m predictor.onnx_export  # the ONNX embedder, exported locally (no network)
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The docs site (mkdocs-material over docs/, into site/): strict, so a broken link or anchor
# between pages, or a page missing from the navigation, fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The timing tests (marker `timing`: fidelity and validation against the real vLLM CPU build)
# run first, in their own pytest process, so that no other test's server or child is alive
# while they measure; then everything else.
timing: $(STAMP)
	$(BIN)/pytest -m timing

unit: $(STAMP)
	$(BIN)/pytest -m "not timing"

# The inner loop: lint, types and every test that needs no real engine or other slow server.
test-fast: lint typecheck
	$(BIN)/pytest -m "not slow"

# The real vLLM CPU build (its own venv under .cache/, ~75 s and 3.4 GB once) and the tiny model;
# the integration tests' fixture does the same on demand.
vllm-env: $(STAMP)
	$(BIN)/python -m loadgen.vllm_real setup

# Debian packages the tests and benchmarks run for real: Prometheus (server and promtool),
# docker-compose (parses the compose files offline), nginx (the lower bound in the gateway
# overhead benchmark), kubectl (renders the k8s kustomization), redis-server (the shared
# learning tests start it) and ip from iproute2 (the fault tests' network namespace). Each
# tool:package pair is installed when its tool is missing (root); a kubectl from elsewhere
# (e.g. the Cloud SDK) is kept, since the Debian package would conflict with it.
SYSTEM_TOOLS := prometheus:prometheus promtool:prometheus nginx:nginx-light \
	docker-compose:docker-compose kubectl:kubernetes-client redis-server:redis-server ip:iproute2
system-deps:
	@missing=$$(for tp in $(SYSTEM_TOOLS); do command -v $${tp%%:*} >/dev/null || echo $${tp#*:}; done | sort -u); \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "please install the Debian packages:" $$missing; exit 1; fi

# `make test`: lint, types, the docs site, the timing tests alone, then the other tests with
# the 10-minute soak (`make soak`, below) beside them. The soak is light (~10 % of one core with its
# emulator and client) and judges memory, descriptors and counts, not time, so the two can
# share the machine; one after the other would take ~12 minutes more. Both must pass; the
# soak's table is printed after the tests.
test: lint typecheck docs system-deps vllm-env timing
	@log=$$(mktemp); $(MAKE) --no-print-directory soak >$$log 2>&1 & soak=$$!; \
	$(BIN)/pytest -m "not timing"; tests=$$?; \
	wait $$soak; soaked=$$?; echo "--- make soak (beside the tests) ---"; cat $$log; rm -f $$log; \
	[ $$tests -eq 0 ] && [ $$soaked -eq 0 ]

# FCFS vs SageSched through the gateway on an emulated backend (no GPU, no network, < 3 min).
demo: $(STAMP)
	$(BIN)/sagesched demo

# The mixed soak (issue 18 part 3, docs/reliability.md): 10 minutes of streamed and plain
# chat/completions, cancellations, 400s and 429 bursts through a real gateway on an emulated
# backend; fails when the gateway's RSS grows >= 5% after the 2-minute warm-up or its open
# descriptors grow, or a request is lost. SOAK_MINUTES shortens it. SOAK_POLICY: SageSched
# preempting by its index by default (predictor, preemption, relay, queue and error paths);
# `make soak SOAK_POLICY=fcfs` for the relay alone. `make test` runs it beside the tests.
SOAK_MINUTES ?= 10
SOAK_POLICY ?= sagesched:preempt_rule=index
soak: $(STAMP)
	$(BIN)/python bench/soak.py --minutes $(SOAK_MINUTES) --policy $(SOAK_POLICY)

bench-policies: $(STAMP)
	$(BIN)/python bench/policy_core.py

# Rewrite requirements.lock from the venv (after a dependency change in pyproject.toml).
lock: $(STAMP)
	{ sed -n '/^#/p' $(LOCK); $(BIN)/pip freeze --exclude-editable | grep -v '^sagesched=='; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache site
