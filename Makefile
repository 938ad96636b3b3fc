# Two set-up commands: `make serve` (serve the CPU default) and `make test` (run the tests).
PY := .venv/bin/python
TARGET ?= cpu
REPO ?= runtime/model_repository
HOST ?= 127.0.0.1
PORT ?= 9000
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
PYTEST_ARGS ?=
BF16 ?=

.PHONY: setup render serve engine test test-unit bench bench-peer clean

setup:
	@BF16=$(BF16) bash build/setup.sh

# the demo config (deploy/gateway.example.yaml) degrades tiers that allow it to this smaller engine model when the
# default one is saturated (docs/gateway.md, Routing); SMALL_ENGINE= renders the default engine alone
SMALL_ENGINE ?= tensorrt_llm_small:max_seq_len=1024,max_num_tokens=128,max_tokens_in_paged_kv_cache=4096

render: setup
	@$(PY) build/render.py --target $(TARGET) --out $(REPO) $(if $(and $(filter cpu,$(TARGET)),$(SMALL_ENGINE)),--engine $(SMALL_ENGINE)) $(RENDER_ARGS)

CHECKPOINT ?= .cache/models/SmolLM2-135M-Instruct
ENGINE ?= engines/smollm2-fp8
TP ?= 1

ifeq ($(TARGET),trtllm)
# GPU: the pinned TensorRT-LLM container serves a built engine (docs/gpu.md); DRY_RUN=1 prints the commands
serve: setup
	@$(PY) build/trtllm.py serve --checkpoint $(CHECKPOINT) --engine $(ENGINE) --tp $(TP) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) $(if $(DRY_RUN),--dry-run)
else
# the front (OpenAI-compatible, the public door) on HOST:PORT; Triton's own ports stay on loopback
serve: render
	@$(PY) -m launcher --repo $(REPO) --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT) \
		--grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)
endif

engine: setup
	@$(PY) build/trtllm.py build --checkpoint $(CHECKPOINT) --engine $(ENGINE) --tp $(TP) $(if $(LORA),--lora-target-modules $(LORA)) $(if $(DRY_RUN),--dry-run)

test: setup
	@bash build/system_deps.sh
	@bash build/setup_aiperf.sh
	@$(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup
	@$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

bench: setup
	@$(PY) benchmarks/triton_bench.py

# optional, not in CI: builds llama.cpp's llama-server (the peer) from the pinned PyPI sdist and measures it
# beside every layer of the project in one window (about 10 min to build, 15 min to run on 2 cores)
bench-peer: setup
	@bash benchmarks/peer/build_llama_server.sh
	@$(PY) benchmarks/triton_bench.py --layers peer,ensemble,gateway,front --out benchmarks/results/latest-peer.json

clean:
	rm -rf runtime .pytest_cache
