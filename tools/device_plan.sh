#!/bin/bash
# One device call that does what the card allows (twenty-first session): on an H200 the GPU
# tests and the table with its peers (BERT shapes and evaluation; PART=large for the wide
# heads), on an H100 the tests and the open A/B experiments (NOTES.md, twentieth section's end).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu, $(date -u +%FT%TZ)" | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/device.txt"
case "$gpu:${PART:-bert}" in
*H200*:bert) STEPS="tests bench" BENCH_TIMEOUT=420 \
    BENCH_SHAPES=bert8k,mlm,bert16k,logsoftmax,bert16k_eval,mlm_eval \
    BENCH_METHODS=fused_ce,fused_ce_lowmem,eager,compile,liger,floor bash tools/gpu_steps.sh ;;
*H200*:large) STEPS=large LARGE_TIMEOUT=560 LARGE_SHAPES=llama3,gemma2,llama3_eval,gemma2_eval \
    LARGE_METHODS=fused_ce,fused_ce_lowmem,compile,liger,cce,floor bash tools/gpu_steps.sh ;;
*:bert) STEPS="tests tiles_cfg" TILES_SHAPES=bert16k_eval,llama3_eval \
    TILES_CFGS='{};{"stats_stages": 4}' bash tools/gpu_steps.sh ;;
*:large) STEPS=tiles_cfg TILES_SHAPES=llama3,gemma2 TILES_CFGS='{};{"overlap": true}' \
    bash tools/gpu_steps.sh ;;
esac
