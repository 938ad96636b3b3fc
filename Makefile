# Two set-up commands: `make serve` (serve the CPU default) and `make test` (run the tests).
PY := .venv/bin/python
TARGET ?= cpu
REPO ?= runtime/model_repository
HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
PYTEST_ARGS ?=

.PHONY: setup render serve test test-unit bench clean

setup:
	@bash build/setup.sh

render: setup
	@$(PY) build/render.py --target $(TARGET) --out $(REPO) $(RENDER_ARGS)

serve: render
	@$(PY) build/serve.py --repo $(REPO) --host $(HOST) --http-port $(HTTP_PORT) \
		--grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

test: setup
	@bash build/system_deps.sh
	@$(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup
	@$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

bench: setup
	@$(PY) benchmarks/triton_bench.py

clean:
	rm -rf runtime .pytest_cache
