#!/usr/bin/env bash
# What a lent GPU runs, in one call (docs/benchmarks.md, section gpu, says how its figures were made): the gpu
# test tier, then bench/gpu.py's plan and speed rows. The device machine has its own torch and no network, so
# the call carries the wheels of the project's other pinned dependencies in .whl/ (bitsandbytes cut to its CUDA
# 13 libraries to fit the transfer) and SmolLM2's config and tokenizer in build/gpu-carry/smollm2/.
# Logs and JSON go to $OUT; each stage has its own time limit so a slow one cannot eat the lease.
set -u
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, peft, bitsandbytes, trl, accelerate; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'peft', peft.__version__, 'bitsandbytes', bitsandbytes.__version__, \
'trl', trl.__version__, 'accelerate', accelerate.__version__)" | tee -a "$OUT/gpu.txt"
stage() {  # stage NAME SECONDS COMMAND...: run with a limit, keep its log, say how it ended
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - started)) s"
}
stage tests "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -p no:xdist -m gpu tests/gpu -rs
tail -25 "$OUT/tests.log"
stage build 60 python3 bench/gpu.py build --arch-dir build/gpu-carry/smollm2
stage plan "${PLAN_S:-100}" python3 bench/gpu.py plan --out "$OUT"
cat "$OUT/plan.log"
stage speed "${SPEED_S:-200}" python3 bench/gpu.py speed --out "$OUT" --rounds "${ROUNDS:-2}"
cat "$OUT/speed.log"
