# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates the virtual environment it needs; torch is pinned and installed first. From public PyPI a
# Linux torch wheel is the CUDA build: TORCH_INDEX=https://download.pytorch.org/whl/cpu installs the CPU one.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
DGPIPE  = $(VENV)/bin/dgpipe
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=
HTTP_PORT ?= 18000
GRPC_PORT ?= 18001
METRICS_PORT ?= 18002
OPENAI_PORT ?= 18003
OUT    ?= $(HOME)/.cache/dgpipe/demo
PUZZLE ?= 14...9..56925.31.8835.1.927..1732.5.259.6.7.437694.28....6.4.935.3.914..92....816

.PHONY: demo test test-fast lint venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install --quiet -e ".[test,bench,serve,quantize,engine]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(DGPIPE) doctor
	@echo "== solve a Sudoku with the embedded DiffusionGemma (givens pinned, adaptive steps)"
	$(DGPIPE) generate "$(PUZZLE)"
	@echo "== the same puzzle as JSON (tokens, steps per canvas, timings)"
	$(DGPIPE) generate "$(PUZZLE)" --json
	@echo "== the embedded model is a Sudoku solver: held-out puzzles with 45-61 givens (its band), diffusion with"
	@echo "   givens pinned / unpinned / left-to-right decoding of the same weights, on the same puzzles"
	$(DGPIPE) eval sudoku --n 100 --givens 45-61 --arms pinned,unpinned,ar
	@echo "== package a Triton model repository, serve it with a real tritonserver, query HTTP, gRPC and the OpenAI API"
	$(DGPIPE) package --output "$(OUT)/model_repository"
	@set -e; $(DGPIPE) serve --repo "$(OUT)/model_repository" --address 127.0.0.1 \
	    --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
	    --openai-port $(OPENAI_PORT) > "$(OUT)/serve.out" & pid=$$!; \
	  trap 'kill -INT $$pid 2>/dev/null; wait $$pid 2>/dev/null || true' EXIT; \
	  for i in $$(seq 1 120); do grep -q "^ready  OpenAI" "$(OUT)/serve.out" 2>/dev/null && break; sleep 1; done; cat "$(OUT)/serve.out"; \
	  echo "-- HTTP generate_stream"; $(DGPIPE) generate --url http://127.0.0.1:$(HTTP_PORT) "$(PUZZLE)"; \
	  echo "-- gRPC streaming"; $(DGPIPE) generate --url grpc://127.0.0.1:$(GRPC_PORT) "$(PUZZLE)" --stream --json; \
	  echo "-- OpenAI API (the openai client)"; $(PY) -c 'import sys, openai; \
	    c = openai.OpenAI(base_url=sys.argv[1], api_key="none").chat.completions.create(model="dgpipe", \
	    messages=[{"role": "user", "content": sys.argv[2]}], max_tokens=82); \
	    print(c.choices[0].message.content, c.usage)' http://127.0.0.1:$(OPENAI_PORT)/v1 "$(PUZZLE)"

# Test files run in parallel worker processes (pytest-xdist), one file per worker at a time: a file's
# module-scoped server or build is started once and shared by its tests.
TEST_WORKERS ?= 2

test: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadfile

# The unit tests minus those marked slow (ModelOpt calibration, nvcc builds, training): a few minutes.
test-fast: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests/unit -m "not slow"

lint: venv
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
