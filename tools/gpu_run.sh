#!/bin/bash
# One device call: install carried peer wheels, GPU tests, kernel sweep, benchmark.
#   bash tools/gpu_run.sh [tests] [sweep] [bench] [bench_ours]   (default: all three of the first)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
steps=${*:-tests sweep bench}
for s in $steps; do
  case $s in
    tests) timeout 170 python3 -m pytest -q -rs --tb=short tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    sweep) timeout 200 python3 tools/sweep.py ${SWEEP_ARGS} 2>&1 | tee "$OUT/sweep.log" ;;
    bench) timeout 375 python3 benchmarks/bench.py --out "$OUT/bench" ${BENCH_ARGS} 2>&1 | tee "$OUT/bench.log" | grep -v Warning ;;
  esac
done
