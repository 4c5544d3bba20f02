# `make run` starts the proxy on config.example.yaml (PORT=, HOST=, DB=, CONFIG= override); `make test` runs the tests.
# Both create .venv on first use (a fresh machine needs only python3 >= 3.11).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test demo bench bench-floor lint clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV) || ($(PYTHON) -m pip install --user virtualenv && $(PYTHON) -m virtualenv $(VENV))
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

# `make run PORT=4100 HOST=0.0.0.0 DB=/tmp/t.duckdb CONFIG=my.yaml` overrides the config's port,
# interface and ledger, or the config file itself.
CONFIG ?= config.example.yaml

run: $(BIN)/.installed
	$(BIN)/tokenward serve --config $(CONFIG)$(if $(PORT), --port $(PORT))$(if $(HOST), --host $(HOST))$(if $(DB), --db $(DB))

test: $(BIN)/.installed
	$(BIN)/python -m pytest

demo: $(BIN)/.installed
	$(BIN)/tokenward demo

# tokenward against calling the mock directly and a bare Python relay, pinned as in issue 13
# (wants nginx, its echo module and wrk: apt-get install -y nginx libnginx-mod-http-echo wrk);
# options through ARGS: make bench ARGS="--postgres --repeat 3"
bench bench-floor: $(BIN)/.installed
	$(BIN)/python bench/bench_floor.py $(ARGS)

lint: $(BIN)/.installed
	$(BIN)/ruff check proxy pricing reports tests bench

clean:
	rm -rf $(VENV) build *.egg-info
