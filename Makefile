# Targets are what CI runs. `make run` and `make test` are the two commands in the README.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: setup run test protos bench clean docker-engine images chaos etcd

$(BIN)/diloco: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned, so nothing later pulls a multi-GB CUDA build
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	@touch $@

setup: $(BIN)/diloco

run: setup
	$(BIN)/diloco local --workers 4 --mode decoupled --slowdown 1,1,1,4 --outer-steps 30

test: setup
	@bash scripts/install_etcd.sh || echo "make test: no etcd binary (install etcd-server as root); the leadership tests against a real etcd are skipped"
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -q

# The leadership tests start a real etcd (Debian's etcd-server); installs it when missing (needs root).
etcd:
	bash scripts/install_etcd.sh

protos: setup
	$(BIN)/python scripts/gen_protos.py

bench: setup
	$(BIN)/diloco bench  # the whole suite, at one commit, into docs/benchmarks

# Containers: start a Docker engine (installs docker.io when missing), build the images offline, run the
# chaos suite (kills and pauses containers while training goes on).
docker-engine:
	bash scripts/start_docker.sh

images: setup docker-engine
	PYTHON=$(BIN)/python bash scripts/build_images.sh

chaos: images
	DILOCO_CHAOS_REQUIRE=1 $(BIN)/pytest -q -m chaos tests/chaos

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache wheelhouse
