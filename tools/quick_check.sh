#!/bin/bash
# Short device call: the row-chunk path's GPU tests and the BERT-class benchmark rows.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 75 python3 -m pytest -q -rs --tb=line tests/test_gpu.py \
  -k "row_chunks or public_api or log_softmax" 2>&1 | grep -v Warn | tee "$OUT/tests.log" | tail -12
timeout 60 python3 benchmarks/bench.py --out "$OUT/bench" --shapes bert8k,mlm,bert16k,logsoftmax \
  --methods fused_ce,kernels --rep-ms 100 2>&1 | grep -v Warn | tee "$OUT/bench.log" | tail -11
