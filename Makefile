# Two entry points for a new user (see README): `make demo` and `make test`.
# Each creates .venv and builds the C++ extension on first use; later runs only rebuild what changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenlake-installed
CSRC := $(wildcard csrc/*.cpp csrc/*.h)
# the device check's wheels (see gpu-wheels below)
GPU_WHEELS := flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 pyzmq==27.3.0
GPU_WHEELS_DIR := .gpu-wheels
GPU_PAYLOAD := .gpu-payload/gpu-payload.tar.xz

.PHONY: demo test lint format bench clean gpu-wheels

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" numpy scipy xxhash msgpack pyzmq matplotlib \
		pytest hypothesis ruff
	touch $@

# the model engine and the server (a separate stamp, so existing venvs pick them up)
$(VENV)/.deps-model: $(VENV)/.deps
	$(PY) -m pip install -q "transformers>=5,<6" safetensors tokenizers fastapi uvicorn httpx
	touch $@

# structured outputs (xgrammar: CPU wheels; its metadata wants torch, held at the CPU build)
# and jsonschema, which the structured-output tests validate against; langchain-openai and
# litellm, which the tests drive the server with (bind_tools, with_structured_output, tools)
$(VENV)/.deps-structured: $(VENV)/.deps-model
	echo "torch==2.13.0" > $(VENV)/torch-pin.txt
	$(PY) -m pip install -q -c $(VENV)/torch-pin.txt "xgrammar>=0.2.7,<0.3" jsonschema \
		"langchain-openai>=1.0" litellm
	touch $@

# SGLang for tests/sglang (the [sglang] extra's version). Its metadata pins a CUDA torch, so it
# goes in without dependencies, then what its imports need, with torch held at the CPU build.
SGLANG_IMPORT_DEPS := orjson psutil pybase64 pillow starlette msgspec triton pydantic tqdm aiohttp \
	ipython dill sentencepiece requests apache-tvm-ffi compressed-tensors gguf openai \
	partial-json-parser einops

$(VENV)/.sglang: $(VENV)/.deps-model
	echo "torch==2.13.0" > $(VENV)/torch-pin.txt
	$(PY) -m pip install -q --no-deps "sglang==0.5.23"
	$(PY) -m pip install -q --no-warn-conflicts -c $(VENV)/torch-pin.txt $(SGLANG_IMPORT_DEPS)
	touch $@

# What SGLang's own server (python -m sglang.launch_server) imports on top, for the tests that
# start real servers on CPU (tests/sglang/cpu_support); same torch pin. A separate stamp, so
# existing venvs pick them up.
SGLANG_SERVER_DEPS := uvloop python-multipart interegular xgrammar soundfile openai-harmony \
	tiktoken llguidance blobfile pycryptodomex zstandard watchfiles distro easydict anthropic ninja

$(VENV)/.sglang-server: $(VENV)/.sglang
	$(PY) -m pip install -q --no-warn-conflicts -c $(VENV)/torch-pin.txt $(SGLANG_SERVER_DEPS)
	touch $@

# FlashInfer's Python API only (imports on CPU with --no-deps): its released signatures are
# checked against every call the engines make (tests/engines/test_flashinfer_calls.py)
$(VENV)/.deps-flashinfer: $(VENV)/.deps
	$(PY) -m pip install -q --no-deps "flashinfer-python==0.7.2.post1" apache-tvm-ffi nvidia-ml-py requests
	touch $@

# /metrics (prometheus-client) and progress bars (tqdm) (a separate stamp, so existing venvs get them)
$(VENV)/.deps-ops: $(VENV)/.deps
	$(PY) -m pip install -q "prometheus-client>=0.17" "tqdm>=4.60"
	touch $@

# the SGLang router for `tokenlake bench wallclock` and its test (the [bench] extra's version)
$(VENV)/.deps-router: $(VENV)/.deps
	$(PY) -m pip install -q "sglang-router==0.3.2"
	touch $@

# Ray for the multi-node launch and tests/serve/ray (the [cluster] extra's version)
$(VENV)/.deps-cluster: $(VENV)/.deps
	$(PY) -m pip install -q "ray==2.60.0"
	touch $@

$(STAMP): $(VENV)/.deps $(VENV)/.deps-model $(VENV)/.deps-structured $(VENV)/.deps-flashinfer $(VENV)/.deps-ops $(VENV)/.deps-router $(VENV)/.deps-cluster pyproject.toml CMakeLists.txt $(CSRC)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

demo: $(STAMP)
	$(VENV)/bin/tokenlake demo $(ARGS)

test: $(STAMP) $(VENV)/.sglang $(VENV)/.sglang-server $(GPU_WHEELS_DIR)/.downloaded
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q $(ARGS)

format: $(VENV)/.deps
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf build $(VENV)

# What the device machine lacks, for tests/gpu/device_check.sh: exactly these wheels (pinned; the
# device installs them with --no-index --no-deps) for its Python 3.12, downloaded into an ignored
# folder, then packed into one .tar.xz that fits a device call with the tree (tests/gpu/gpu_payload.py).
# The download never fails `make test`: without an index the device-check rehearsal skips, saying so.
$(GPU_WHEELS_DIR)/.downloaded:
	rm -rf $(GPU_WHEELS_DIR)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 -d $(GPU_WHEELS_DIR) $(GPU_WHEELS) \
		&& touch $@ || echo "gpu-wheels: no package index reachable; the device-check rehearsal skips"

gpu-wheels: $(GPU_WHEELS_DIR)/.downloaded
	$(PYTHON) tests/gpu/gpu_payload.py build --wheels $(GPU_WHEELS_DIR) --payload $(GPU_PAYLOAD)
	du -h $(GPU_PAYLOAD)
