#!/bin/bash
# The twenty-first session's device calls: PART=bert the GPU tests and the BERT shapes
# (training, log-softmax, evaluation) with their peers; PART=large the wide heads (training and
# evaluation) with theirs; PART=exp the open A/B experiments (NOTES.md, twentieth section's end).
# The card's name goes to device.txt: an H100's numbers compare methods within the call only.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu, $(date -u +%FT%TZ)" | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/device.txt"
case ${PART:-bert} in
bert) STEPS="tests bench" BENCH_TIMEOUT=420 \
    BENCH_SHAPES=bert8k,mlm,bert16k,logsoftmax,bert16k_eval,mlm_eval \
    BENCH_METHODS=fused_ce,fused_ce_lowmem,eager,compile,liger,floor bash tools/gpu_steps.sh ;;
large) STEPS=large LARGE_TIMEOUT=560 REP_MS=1000 LARGE_SHAPES=llama3,gemma2,llama3_eval,gemma2_eval \
    LARGE_METHODS=fused_ce,fused_ce_lowmem,compile,liger,cce,floor bash tools/gpu_steps.sh ;;
exp) STEPS=tiles_cfg TILES_ROUNDS=1 TILES_SHAPES=bert16k_eval,llama3_eval \
    TILES_CFGS='{};{"stats_stages": 4}' bash tools/gpu_steps.sh
    STEPS=tiles_cfg TILES_ROUNDS=1 TILES_SHAPES=llama3,gemma2 TILES_CFGS='{};{"overlap": true}' \
    bash tools/gpu_steps.sh ;;
esac
