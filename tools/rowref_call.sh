#!/bin/bash
# The thirty-fourth session's first device call (~550 s): the row-reference option (NOTES.md
# #95) on a device: its GPU tests, one A/B round against the D pass (with Zipf-drawn targets
# too), the error probe, then on an H200 the wide heads with their peers (the table
# rows), on another card a second A/B round; last the kernels' profile at Gemma-2. Most
# wanted first: a call cut short keeps what it wrote under $OUT. Carry .whl.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu, $(date -u +%FT%TZ)" | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "row_ref or captured" 2>&1 \
  | grep -v Warn | tail -15 | tee "$OUT/tests_rowref.log"
ab() { timeout 150 python3 benchmarks/bench.py --out "$OUT/ab$1" --rep-ms 300 --warmup-ms 50 \
  --warmup-steps 2 --shapes ${AB_SHAPES:-gemma2,gemma2_zipf,llama3} \
  --methods fused_ce_rowref,fused_ce_dpass 2>&1 | grep -E "^(llama3|gemma2)(_zipf)? " \
  | tee -a "$OUT/ab.log"; }
ab 1
[ -n "$SHORT" ] && exit 0  # (SHORT=1: the tests and one A/B round only)
timeout 80 python3 tools/probe_row_ref.py 2>&1 | grep -v Warn | tee "$OUT/probe_row_ref.log"
case "$gpu" in
  *H200*) OUT=$OUT STEPS=large LARGE_TIMEOUT=170 REP_MS=300 LARGE_SHAPES=gemma2,llama3 \
      LARGE_METHODS=fused_ce_rowref,fused_ce,compile,liger,floor bash tools/gpu_steps.sh ;;
  *) ab 2 ;;
esac
PYTHONPATH=/tmp/site:. timeout 100 python3 tools/profile_kernels.py --shapes gemma2 \
  --methods fused_ce_dpass,fused_ce_rowref --rows 8 2>&1 | grep -v Warn > "$OUT/profile.log"
grep -A9 "^===" "$OUT/profile.log"
