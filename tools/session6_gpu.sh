#!/bin/bash
# Sixth session's device call: GPU tests, the BERT shapes with peers, an A/B against the
# session-start code (ab_old/, a git archive of 9eb7304), the large shapes, the HF step.
# ab_old/ (not in git) is the session-start tree, made before the call with
#   mkdir ab_old && git archive 9eb7304 | tar -x -C ab_old
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/fc . >/dev/null 2>&1
export PYTHONPATH=/tmp/site
B="--rep-ms 200 --warmup-ms 50"
timeout 200 python3 -m pytest -q -rs --tb=short -p no:cacheprovider tests/test_gpu.py 2>&1 | grep -v Warn | tail -15 | tee "$OUT/tests.log"
timeout 240 python3 benchmarks/bench.py --out "$OUT/bert" $B --shapes bert8k,mlm,bert16k \
  --methods fused_ce,kernels,fused_ce_sweep,fused_ce_lowmem,compile,liger,floor 2>&1 | grep -v Warn > "$OUT/bert.log"
for v in old new old new; do d=.; [ $v = old ] && d=ab_old
  echo "== $v"; timeout 60 python3 $d/benchmarks/bench.py --out /tmp/ab $B --shapes bert8k,mlm,bert16k \
    --methods fused_ce,kernels 2>&1 | grep -E "^(mlm|bert8k|bert16k) " | sort -u; done | tee "$OUT/ab.log"
timeout 150 python3 benchmarks/bench.py --out "$OUT/large" $B --shapes llama3,gemma2 \
  --methods fused_ce,floor 2>&1 | grep -v Warn > "$OUT/large.log"
PYTHONPATH=/tmp/fc:$PYTHONPATH timeout 60 python3 benchmarks/hf_bert_mlm.py --steps 20 --warmup 3 \
  --markdown "$OUT/hf_bert_mlm.md" 2>&1 | grep -v Warn | tail -8 | tee "$OUT/hf.log"
timeout 60 python3 tools/profile_gaps.py --shapes bert8k,mlm --methods fused_ce,kernels --steps 10 --rows 10 2>&1 | grep -v Warn > "$OUT/gaps.log"
tail -30 "$OUT/bert.log"; tail -6 "$OUT/large.log"; cat "$OUT/ab.log"
