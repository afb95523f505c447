#!/bin/bash
# Twelfth session's device calls. STEPS among: probe (tools/probe_persistent_logits.py), tests
# (GPU tests), ab (fused_ce and kernels: ab_old/ = the session-start tree vs this one,
# alternating; ab_old: mkdir ab_old && git archive 603d77e | tar -x -C ab_old), tiles and large
# (the logits epilogue path vs cuBLAS fp32 Z in this tree: fused_ce_epilogue vs
# fused_ce_fp32z), bench
# (BERT shapes with the peers).
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
B="--rep-ms 200 --warmup-ms 50"
ab() {  # shapes, methods, rounds
  for r in $(seq $3); do for v in old new; do d=.; [ $v = old ] && d=ab_old
    echo "== $v"; timeout 150 python3 $d/benchmarks/bench.py --out /tmp/ab $B --shapes $1 \
      --methods $2 2>&1 | grep -E "^(mlm|bert8k|bert16k|llama3|gemma2) " | sort -u; done; done
}
for step in ${STEPS:-probe tests ab}; do case $step in
probe) timeout 240 python3 tools/probe_persistent_logits.py --shapes ${PROBE_SHAPES:-bert2k,llama2k} \
         2>&1 | grep -v Warn | tee "$OUT/probe.log" ;;
tests) timeout 240 python3 -m pytest -q -rs --tb=short -p no:cacheprovider tests/test_gpu.py 2>&1 \
         | grep -v Warn | tail -25 | tee "$OUT/tests.log" ;;
ab) ab ${AB_SHAPES:-bert8k,mlm,bert16k} fused_ce,kernels ${AB_ROUNDS:-2} | tee "$OUT/ab.log" ;;
tiles) for r in $(seq ${TILES_ROUNDS:-2}); do timeout 200 python3 benchmarks/bench.py --out "$OUT/tiles$r" $B \
         --shapes ${TILES_SHAPES:-bert8k,mlm,bert16k} --methods fused_ce_epilogue,fused_ce_fp32z 2>&1 \
         | grep -v Warn | tail -12; done | tee "$OUT/tiles.log" ;;
large) timeout 200 python3 benchmarks/bench.py --out "$OUT/large" $B --shapes llama3,gemma2 \
         --methods fused_ce_epilogue,fused_ce_fp32z 2>&1 | grep -v Warn | tail -8 | tee "$OUT/large.log" ;;
bench) timeout 300 python3 benchmarks/bench.py --out "$OUT/bert" $B \
         --shapes ${BENCH_SHAPES:-bert8k,mlm,bert16k} \
         --methods ${BENCH_METHODS:-fused_ce,kernels,compile,liger,floor} 2>&1 | grep -v Warn \
         | tee "$OUT/bert.log" | tail -30 ;;
esac; done
