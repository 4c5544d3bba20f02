# `make run` starts the proxy on config.example.yaml; `make test` runs the test suite.
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

run: $(BIN)/.installed
	$(BIN)/tokenward serve --config config.example.yaml

test: $(BIN)/.installed
	$(BIN)/python -m pytest

demo: $(BIN)/.installed
	$(BIN)/tokenward demo

# tokenward against calling the mock directly and a bare Python relay, pinned as in issue 13
# (wants nginx, its echo module and wrk: apt-get install -y nginx libnginx-mod-http-echo wrk)
bench bench-floor: $(BIN)/.installed
	$(BIN)/python bench/bench_floor.py

lint: $(BIN)/.installed
	$(BIN)/ruff check proxy pricing reports tests bench

clean:
	rm -rf $(VENV) build *.egg-info
