# Two commands on a fresh machine: `make run` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-all clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/systolic train lm

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not gpu and not tpu" --durations=40

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not gpu and not tpu"

clean:
	rm -rf $(VENV) runs .pytest_cache
