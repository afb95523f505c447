#!/bin/bash
# Sixth session: the HF BERT-large step, the session-start code (ab_old/) against this tree, and
# the GPU tests.
# ab_old/ (not in git) is the session-start tree, made before the call with
#   mkdir ab_old && git archive 9eb7304 | tar -x -C ab_old
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/fc . >/dev/null 2>&1
(cd ab_old && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/fc_old . >/dev/null 2>&1)
for v in new old new old; do
  site=/tmp/fc; [ $v = old ] && site=/tmp/fc_old
  echo "== $v"; PYTHONPATH=$site timeout 70 python3 benchmarks/hf_bert_mlm.py --steps 20 --warmup 3 \
    --markdown "$OUT/hf_$v.md" 2>&1 | grep -E "^\| (un)?patched|Speed-up"
done | tee "$OUT/hf_ab.log"
timeout 200 python3 -m pytest -q -rs --tb=short -p no:cacheprovider tests/test_gpu.py 2>&1 | grep -v Warn | tail -12 | tee "$OUT/tests.log"
