PY ?= python3

.PHONY: setup run test lint bench

setup:
	@PYTHON=$(PY) scripts/setup.sh

# The main job on its embedded default: CPU (or the GPU if present), torch_mla, tiny_mla, workload=smoke.
run: setup
	$(PY) -m runtime $(ARGS)

# The test suite (GPU tests skip without CUDA).
test: setup
	$(PY) -m pytest -q $(ARGS)

lint: setup
	$(PY) -m ruff check .
