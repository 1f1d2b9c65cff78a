# The stream image: the Faust job, the bridge, the billing sink and the CLI
# (`make setup`'s .venvs/stream). faust-streaming and vLLM cannot share an environment
# (README, "Two environments"), so the workers have an image of their own.
FROM python:3.11-slim
WORKDIR /opt/tokenbus
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY tokenbus tokenbus
COPY producers producers
COPY stream_jobs stream_jobs
COPY workers workers
COPY billing billing
COPY bridge bridge
RUN pip install --no-cache-dir '.[stream]'
RUN useradd --system --home-dir /var/lib/tokenbus --create-home tokenbus
USER tokenbus
ENV TOKENBUS_HOME=/var/lib/tokenbus TOKENBUS_BROKER_PROFILE=kafka
CMD ["python", "-m", "stream_jobs"]
