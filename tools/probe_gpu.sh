#!/bin/bash
# One device call: the row-chunk probe (pieces and whole path at several Z budgets), then the
# GPU tests. Outputs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/probe.log"
timeout ${T_PROBE:-300} python3 tools/probe_rowchunks.py ${PROBE_ARGS:---parts} 2>&1 | grep -v Warn | tee -a "$OUT/probe.log"
timeout ${T_TESTS:-200} python3 -m pytest -q -rs --tb=short -p no:cacheprovider tests/test_gpu.py ${TESTS_ARGS} 2>&1 \
  | grep -v Warn | tee "$OUT/gpu_tests.log" | tail -30
