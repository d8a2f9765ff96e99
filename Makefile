# Every target sets up .venv on first use (Python >= 3.10 on PATH as python3, or PYTHON=...).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The main job: the token-mixer ablation on the offline digits data.
demo: $(STAMP)
	$(BIN)/python tools/ablate.py --config configs/ablate_digits.yaml

# The test suite (the default, lean run; CI runs this).
test: $(STAMP)
	$(BIN)/python -m pytest -q

# Including the cases marked slow.
test-all: $(STAMP)
	$(BIN)/python -m pytest -q --runslow
