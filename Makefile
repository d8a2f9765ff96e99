# Every target sets up .venv on first use (Python >= 3.10 on PATH as python3, or PYTHON=...).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BASE_STAMP := $(VENV)/.installed-base

.PHONY: install demo test test-all test-latest docs gpu-report gpu-wheels

# The tested versions: constraints.txt pins every package (pyproject.toml keeps the ranges users install into).
# The library and its tools alone (torch, timm, triton, ...): what the demo needs.
$(BASE_STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt pip
	$(BIN)/python -m pip install -q -c constraints.txt -e .
	touch $(BASE_STAMP)

# With the test extras (diffusers, transformers, ONNX, the manual's MkDocs): what the tests and the manual need.
$(STAMP): $(BASE_STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The main job: the token-mixer ablation on the offline digits data. The first run installs the library into
# .venv first (torch with its CUDA libraries is most of it: minutes, mostly download).
demo: $(BASE_STAMP)
	@echo "linvision-ablate: 4 token mixers, each trained 6 epochs, evaluated at 3 sizes, then timed together at 3; results in output/ablate_digits/"
	$(BIN)/linvision-ablate --config ablate_digits

# The test suite (the default, lean run; CI runs this): a worker per free core, each test file on one worker
# (pytest-xdist; on a machine with under two free cores, in one process: tests/conftest.py).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile

# Including the cases marked slow.
test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile --runslow

# The GPU report (docs/kernels.md, "The GPU report"): in --budget seconds (540 by default), by value, the models
# against timm's in their run modes (the headline), the kernels against SDPA, the recurrences, the CUDA tests
# (pytest -m cuda); report.md and report.json in output/gpu_report/, rewritten as each part's rows come.
# GPU_REPORT_ARGS passes flags on.
# On a bare GPU machine without network (python3 holding torch and triton), after `make gpu-wheels` here:
# the wheels of .whl/ go into $(GPU_SITE) (about 5 s, no index, no dependencies resolved) and python3 runs the
# report from there. Elsewhere it runs in .venv; without CUDA that is the dry run (tiny sizes on the CPU).
GPU_SITE ?= /tmp/linvision-gpu-site
gpu-report:
	@if [ -d .whl ] && ! [ -x $(BIN)/python ]; then \
		python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) \
			.whl/*.whl && PYTHONSAFEPATH=1 PYTHONPATH=$(GPU_SITE) python3 -m linvision.tools.gpu_report \
			$(GPU_REPORT_ARGS); \
	else $(MAKE) $(STAMP) && $(BIN)/linvision-gpu-report $(GPU_REPORT_ARGS); fi

# The wheels a bare GPU machine lacks, into .whl/ (ignored by git; ~4.4 MB): linvision built from this checkout,
# fla-core, timm and segmentation-models-pytorch (docs/segmentation.md's examples, run by the CUDA tests) at the
# tested versions (pure Python; torch, triton and the other requirements are the machine's own).
gpu-wheels: $(BASE_STAMP)
	rm -rf .whl && mkdir -p .whl
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w .whl .
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: -c constraints.txt -d .whl fla-core timm \
		segmentation-models-pytorch

# The manual, with every warning an error, into site/ (open site/index.html); the test suite builds it the same way.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# Not for CI: the suite against the newest releases of every dependency (upper bounds of pyproject.toml
# ignored), in its own .venv-latest, to see the next breakage before a user does. When it passes,
# `.venv-latest/bin/pip freeze --exclude-editable > constraints.txt` moves the pins forward.
test-latest:
	test -x .venv-latest/bin/python || $(PYTHON) -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q --upgrade pip
	.venv-latest/bin/python -m pip install -q -e ".[dev]"
	.venv-latest/bin/python -m pip install -q --upgrade torch torchvision timm triton einops safetensors pyyaml \
		tqdm numpy pillow matplotlib scikit-learn pytest diffusers onnx onnxscript onnxruntime mkdocs \
		mkdocs-material "mkdocstrings[python]"
	.venv-latest/bin/python -m pip list | grep -iE "^(torch|torchvision|timm|triton) "
	.venv-latest/bin/python -m pytest -q
