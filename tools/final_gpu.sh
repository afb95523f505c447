#!/bin/bash
# One device call for the session's final numbers (each step bounded, outputs under $OUT):
# kernel GPU tests, the benchmark table with peers, the HF BERT-large step benchmark and the
# example's bert-large preset with and without the fused loss.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD:$PWD/.gpu_extra:$PYTHONPATH
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers, lightning; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__)"
  date -u; } 2>&1 | tee -a "$OUT/log.txt"
timeout ${T_BENCH:-170} python3 benchmarks/bench.py --out "$OUT" --rep-ms ${REP_MS:-150} --warmup-ms 50 \
  --shapes bert8k,mlm,bert16k,logsoftmax,llama3,gemma2 \
  --methods fused_ce,fused_ce_rowchunk,fused_ce_lowmem,floor,eager,compile,liger,cce,torch_lce 2>&1 \
  | grep -v Warn | tee -a "$OUT/log.txt" | tail -45
timeout ${T_TESTS:-60} python3 -m pytest -q -rs --tb=line -p no:cacheprovider tests/test_gpu.py \
  -k "${TESTS_K:-row_chunks or public_api or log_softmax}" 2>&1 | grep -v Warn | tee -a "$OUT/log.txt" | tail -8
timeout ${T_HF:-55} python3 benchmarks/hf_bert_mlm.py --steps 6 --warmup 2 --markdown "$OUT/hf_bert_mlm.md" 2>&1 \
  | grep -v Warn | tee -a "$OUT/log.txt" | tail -8
timeout ${T_EX:-100} python3 examples/train_bert_mlm.py --preset bert-large --compare --max-steps ${EX_STEPS:-60} \
  --no-progress-bar --out /tmp/ex 2>&1 | grep -v Warn | tee -a "$OUT/log.txt" | tail -20
find /tmp/ex -maxdepth 2 -name "*.png" -exec cp {} "$OUT/" \; ; find /tmp/ex -maxdepth 2 -name "*.json" | head -3 | xargs -r cat >> "$OUT/log.txt"; ls "$OUT"
