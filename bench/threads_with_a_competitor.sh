#!/bin/bash
# The demo with one competing busy process: gpupoor's thread choice (auto) against 2 threads, alternating.
cd "$(dirname "$0")/.."
probe() { .venv/bin/python -c "
import torch, time; torch.set_num_threads(2); a=torch.randn(1024,1024); b=torch.randn(1024,1024)
for _ in range(3): a@b
t=time.perf_counter(); n=20
for _ in range(n): a@b
print(f'{2*1024**3*n/(time.perf_counter()-t)/1e9:.0f}')"; }
echo "probe before: $(probe) GFLOP/s (quiet)"
for round in 1 2; do
  for setting in auto 2; do
    extra=""; [ "$setting" = 2 ] && extra="--set training.cpu_threads=2"
    python3 -c "while True: pass" & P=$!; sleep 1
    rm -rf ${TMPDIR:-/tmp}/gpupoor-threads-run
    out=$(.venv/bin/gpupoor train recipes/demo.yaml --output-dir ${TMPDIR:-/tmp}/gpupoor-threads-run $extra 2>&1)
    kill $P
    echo "round $round threads=$setting: $(echo "$out" | grep -o 'threads [0-9] ([^)]*)') | $(echo "$out" | grep -o 'done: [0-9]* steps in [0-9.]* s')"
  done
  echo "probe after round $round: $(probe) GFLOP/s (quiet)"
done
