#!/bin/bash
# Device calls of the seventh to twentieth sessions. STEPS picks among:
#   finish          the finish kernels alone
#   ab              bench methods AB_METHODS (fused_ce,kernels), session start vs now, in the
#                   order AB_ORDER (old new old new) in one call, AB_TIMEOUT s each (60) (new is
#                   this tree, any other name NAME the tree in ab_NAME/: mkdir ab_old && git
#                   archive REV | tar -x -C ab_old); AB_PREFIX: a command each run goes
#                   through (e.g. "taskset -c 5": one core, less spread between runs)
#   ab_inproc       old (ab_$AB_OLD, default ab_old) and this tree in one process, their steps
#                   alternating (tools/ab_in_process.py) at AB_SHAPES (mlm,mlm_eval): host-bound
#                   A/Bs without the spread between processes (twenty-sixth session); AB_ARGS:
#                   more of its arguments (e.g. "--softcap 30": the fp32-logits path)
#   db              the db product's cuBLAS kernel by row count
#   tests           GPU tests
#   bench           BERT shapes with peers (BENCH_SHAPES, BENCH_METHODS; the _eval shapes: the
#                   loss under torch.no_grad, methods fused_ce,fused_ce_rowstats,eager,compile,...)
#   large           Llama-3 / Gemma-2 shapes (LARGE_SHAPES, LARGE_METHODS, default fused_ce,floor)
#   upstream        gradient errors with a non-unit upstream gradient (eighth session)
#   finish_once     the one-read finish variants, tools/probe_finish_once.py (ninth)
#   epilogue_probe  tools/probe_persistent_logits.py (twelfth)
#   sweeps          the sweeps' logits kernels, W by descriptor or pointers, per tile
#                   (tools/probe_sweeps.py, fourteenth)
#   epilogue_chunks the row-chunk path with the epilogue logits forced, per E budget
#                   (CHUNK_BUDGETS MiB, 0: the library's), tools/probe_rowchunks.py (fourteenth)
#   mlm_paths       GPU vs host time of the epilogue and fp32 Z paths (tools/probe_mlm_paths.py)
#   profile         GPU time per kernel, wall and busy time (tools/profile_kernels.py) of
#                   PROFILE_METHODS (fused_ce_lowmem) at PROFILE_SHAPES (fifteenth)
#   db_fold         db in the dW product by a ones column on x, tools/probe_db_fold.py
#                   (seventeenth)
#   db_parts        db from partial column sums written with D, per tile shape,
#                   tools/probe_db_parts.py (seventeenth)
#   epilogue        the row chunks' logits by the epilogue GEMM vs cuBLAS fp32 Z, bench methods
#                   fused_ce_epilogue / fused_ce_fp32z (twelfth)
#   overlap         a chunk's statistics + D pass beside the next chunk's logits GEMM on a second
#                   stream, tools/probe_overlap.py at OVERLAP_SHAPES (nineteenth)
#   tiles_cfg       bench method fused_ce at TILES_SHAPES under each logits_tiles override in
#                   TILES_CFGS (JSON objects separated by ';', {} the default), alternating
#                   TILES_ROUNDS times (tools/bench_tiles_config.py, eighteenth)
# REP_MS: do_bench's measuring time per (shape, method), 200 ms by default
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site
B="--rep-ms ${REP_MS:-200} --warmup-ms 50"
for step in ${STEPS:-finish ab tests}; do case $step in
finish) timeout 200 python3 tools/probe_rowchunks.py --finish-only --shapes none 2>&1 \
          | grep -v Warn | tee "$OUT/finish.log" ;;
ab) for v in ${AB_ORDER:-old new old new}; do d=.; [ $v != new ] && d=ab_$v
      echo "== $v"; timeout ${AB_TIMEOUT:-60} $AB_PREFIX python3 $d/benchmarks/bench.py --out /tmp/ab $B \
        --shapes ${AB_SHAPES:-bert8k,mlm,bert16k} --methods ${AB_METHODS:-fused_ce,kernels} \
        2>&1 \
        | grep -E "^(mlm|bert8k|bert16k|llama3|gemma2)(_eval|_softcap)? " | sort -u; done | tee "$OUT/ab.log" ;;
ab_inproc) PYTHONPATH=/tmp/site:. timeout ${AB_TIMEOUT:-240} python3 tools/ab_in_process.py \
         --old ab_${AB_OLD:-old} --shapes ${AB_SHAPES:-mlm,mlm_eval} ${AB_ARGS:-} 2>&1 | grep -v Warn \
         | tee "$OUT/ab_inproc.log" ;;
db_fold) PYTHONPATH=/tmp/site:. timeout 120 python3 tools/probe_db_fold.py 2>&1 | grep -v Warn \
         | tee "$OUT/db_fold.log" ;;
db_parts) PYTHONPATH=/tmp/site:. timeout 200 python3 tools/probe_db_parts.py 2>&1 | grep -v Warn \
         | tee "$OUT/db_parts.log" ;;
db) timeout 60 python3 tools/probe_db_gemm.py 2>&1 | grep -v Warn | tee "$OUT/db.log" ;;
tests) timeout 300 python3 -m pytest -q -rs --tb=short -p no:cacheprovider tests/test_gpu.py 2>&1 \
         | grep -v Warn | tail -15 | tee "$OUT/tests.log" ;;
bench) timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench.py --out "$OUT/bert" $B \
         --shapes ${BENCH_SHAPES:-bert8k,mlm,bert16k} \
         --methods ${BENCH_METHODS:-fused_ce,kernels,compile,liger,floor} 2>&1 | grep -v Warn \
         | tee "$OUT/bert.log" | tail -30 ;;
large) timeout ${LARGE_TIMEOUT:-150} python3 benchmarks/bench.py --out "$OUT/large" $B \
         --warmup-steps 2 --shapes ${LARGE_SHAPES:-llama3,gemma2} --methods ${LARGE_METHODS:-fused_ce,floor} \
         2>&1 | grep -v Warn | tee "$OUT/large.log" | tail -8 ;;
finish_once) timeout 120 python3 tools/probe_finish_once.py 2>&1 | grep -v Warn \
          | tee "$OUT/finish_once.log" ;;
upstream) PYTHONPATH=/tmp/site:. timeout 120 python3 tools/probe_upstream.py 2>&1 | grep -v Warn | tee "$OUT/upstream.log" ;;
epilogue_probe) PYTHONPATH=/tmp/site:. timeout 240 python3 tools/probe_persistent_logits.py \
         --shapes ${PROBE_SHAPES:-bert2k,llama2k} 2>&1 | grep -v Warn | tee "$OUT/probe.log" ;;
epilogue) timeout 300 python3 benchmarks/bench.py --out "$OUT/epilogue" $B \
         --shapes ${EPILOGUE_SHAPES:-bert8k,mlm,bert16k,llama3,gemma2} \
         --methods fused_ce_epilogue,fused_ce_fp32z 2>&1 | grep -v Warn \
         | tee "$OUT/epilogue.log" | tail -12 ;;
epilogue_chunks) PYTHONPATH=/tmp/site:. timeout 300 python3 -c "import sys; sys.path.insert(0, 'tools')
import probe_rowchunks as p; from fused_ce.kernels import config; config.LOGITS_EPILOGUE = True
p.whole('${CHUNK_SHAPES:-bert8k,bert16k}'.split(','), [${CHUNK_BUDGETS:-0,128,200}], ['2048:8'])" \
         2>&1 | grep -v Warn | tee "$OUT/epilogue_chunks.log" ;;
mlm_paths) PYTHONPATH=/tmp/site:. timeout 200 python3 tools/probe_mlm_paths.py 2>&1 | grep -v Warn \
         | tee "$OUT/mlm_paths.log" ;;
profile) PYTHONPATH=/tmp/site:. timeout 240 python3 tools/profile_kernels.py \
         --shapes ${PROFILE_SHAPES:-bert8k,mlm,bert16k} --methods ${PROFILE_METHODS:-fused_ce_lowmem} \
         2>&1 | grep -v Warn | tee "$OUT/profile.log" ;;
sweeps) PYTHONPATH=/tmp/site:. timeout 300 python3 tools/probe_sweeps.py --shapes ${SWEEP_SHAPES:-bert8k,mlm,llama4k,gemma4k} \
         2>&1 | grep -v Warn | tee "$OUT/sweeps.log" ;;
overlap) PYTHONPATH=/tmp/site:. timeout 200 python3 tools/probe_overlap.py --shapes ${OVERLAP_SHAPES:-bert16k,llama3} \
         2>&1 | grep -v Warn | tee "$OUT/overlap.log" ;;
tiles_cfg) for r in $(seq ${TILES_ROUNDS:-2}); do IFS=';'; for c in ${TILES_CFGS:-'{}';'{"split": 1}'}; do
         unset IFS; echo "== $c"; timeout 120 python3 tools/bench_tiles_config.py "$c" --out /tmp/tc $B \
         --shapes ${TILES_SHAPES:-bert8k,bert16k} --methods fused_ce 2>&1 \
         | grep -E "^(mlm|bert8k|bert16k|llama3|gemma2)(_eval|_softcap)? " | sort -u; done; unset IFS; done \
         | tee "$OUT/tiles_cfg.log" ;;
esac; done
