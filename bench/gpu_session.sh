#!/usr/bin/env bash
# What a lent GPU runs, in one call (docs/benchmarks.md, section gpu, says how its figures were made): the gpu
# test tier, then bench/gpu.py's plan and speed rows. The device machine has its own torch and no network, so
# the call carries the wheels of the project's other pinned dependencies in .whl/ (bitsandbytes cut to its CUDA
# 13 libraries to fit the transfer) and SmolLM2's config and tokenizer in build/gpu-carry/smollm2/.
# To prepare them here (once, in the repository root; both paths are git-ignored):
#   echo /.whl/ >> .git/info/exclude; mkdir -p .whl build/gpu-carry/smollm2
#   for spec in pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection transformers==5.24.0 \
#       peft==0.21.2 bitsandbytes==0.50.2 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
#       tokenizers==0.23.3 huggingface_hub==2.4.0 typer==0.29.2 rich==15.0.0 click==8.5.1 filelock==4.3.1 \
#       httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5; do python3 -m pip download -q --no-deps \
#       --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 \
#       --platform manylinux_2_24_x86_64 -d .whl "$spec"; done
#   zip -q -d .whl/bitsandbytes-*.whl 'bitsandbytes/libbitsandbytes_cuda1[12]*.so' \
#       'bitsandbytes/libbitsandbytes_rocm*.so' 'bitsandbytes/libbitsandbytes_xpu*.so'
#   cp ~/.cache/gpupoor/real/SmolLM2-135M-Instruct.Q4_1.fp32/{config.json,tokenizer*.json,chat_template.jinja,\
#       generation_config.json} build/gpu-carry/smollm2/   # after make fetch-real and one real-tier run
# then run it with carry [".whl", "build/gpu-carry"] (about 35 MiB).
# liger-kernel's wheel (pure Python; Triton is there) travels too, for model.kernels: liger.
# Logs and JSON go to $OUT (at most 8 files come back: one log for every stage, the tests' own, the JSON); each stage
# has its own time limit so a slow one cannot eat the lease, and the stages run in the order of what is least
# measured so far: the flagship (issue #47), the MFU rows, the gpu tier, the time plan's rows (issue #43).
set -u
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, peft, bitsandbytes, accelerate, triton, liger_kernel; print('torch', \
torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'bitsandbytes', \
bitsandbytes.__version__, 'accelerate', accelerate.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
want() { [[ " ${STAGES:-probe build flagship mfu tests times} " == *" $1 "* ]]; }  # STAGES: a subset, in this order
want probe && python3 - <<'PROBE' | tee -a "$OUT/gpu.txt"  # the matmul rates the time plan (issue #43) scales by
import time, torch
for m, k, n in [(8192, 8192, 8192), (8192, 1536, 8960), (8192, 8960, 1536), (8192, 1536, 1536), (8192, 576, 1536),
                (8192, 4096, 14336), (4096, 4096, 4096)]:
    a, b = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(); start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize(); seconds = (time.perf_counter() - start) / 20
    print(f"bf16 matmul {m}x{k}x{n}: {2 * m * k * n / seconds / 1e12:.0f} TFLOP/s")
PROBE
stage() {  # stage NAME SECONDS COMMAND...: run with a limit, append its output to session.log, say how it ended
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    echo "== $name" >>"$OUT/session.log"
    timeout "$limit" "$@" >>"$OUT/session.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - started)) s" | tee -a "$OUT/session.log"
}
want build && stage build "${BUILD_S:-60}" python3 bench/gpu.py build --arch-dir build/gpu-carry/smollm2
want flagship && stage flagship "${FLAGSHIP_S:-200}" python3 bench/gpu.py flagship --arch-dir build/gpu-carry/smollm2 \
    --out "$OUT"
want mfu && stage mfu "${MFU_S:-130}" python3 bench/gpu.py mfu --out "$OUT"
if want tests; then
    timeout "${TESTS_S:-80}" python3 -m pytest -q -p no:cacheprovider -p no:xdist -m gpu tests/gpu -rs >"$OUT/tests.log" 2>&1
    echo "== tests: exit $?"; tail -8 "$OUT/tests.log"
fi
want times && stage times "${TIMES_S:-75}" python3 bench/gpu.py times --out "$OUT"
grep -v "Writing model shards\|Loading weights" "$OUT/session.log" | tail -60
