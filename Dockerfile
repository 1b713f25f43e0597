# syntax=docker/dockerfile:1
# SageSched gateway image: `sagesched serve` (and `sagesched emulate` for laptop stacks).
#
# CPU torch by default (the predictor's MiniLM embedder runs fine on a CPU). For a CUDA build
# of torch pass the matching wheel index, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t sagesched:cuda .
# and run it with GPU access (compose: deploy.resources.reservations.devices).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
# Wheel index for torch: .../whl/cpu (default) or a CUDA one such as .../whl/cu128.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the chosen index, so sentence-transformers does not pull another build
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md sagesched_cli.py ./
COPY policies/ policies/
COPY predictor/ predictor/
COPY gateway/ gateway/
COPY loadgen/ loadgen/
RUN pip install .

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="sagesched-gateway" \
      org.opencontainers.image.description="Scheduling gateway in front of vLLM" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    SAGESCHED_HOST=0.0.0.0 \
    SAGESCHED_PORT=8080
COPY --from=build /opt/venv /opt/venv
# Non-root; /var/lib/sagesched holds the predictor snapshot (mount a volume there).
RUN groupadd --system --gid 10001 sagesched \
 && useradd --system --uid 10001 --gid sagesched --home-dir /var/lib/sagesched --create-home sagesched
USER 10001:10001
WORKDIR /var/lib/sagesched
VOLUME ["/var/lib/sagesched"]
EXPOSE 8080
# /health answers 200 while the process serves HTTP (no curl in the slim image).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('SAGESCHED_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["sagesched"]
# Backends come from SAGESCHED_BACKENDS (comma-separated URLs), a --config file or --backend.
CMD ["serve", "--predictor-snapshot", "/var/lib/sagesched/predictor.snapshot"]
