#!/bin/bash
# The twenty-first session's device calls: PART=table every shape of the issue (training,
# log-softmax, evaluation) with its peers in one call; PART=bert / PART=large its halves; PART=all
# the GPU tests and the table without eager at the BERT shapes, shorter; PART=short what ~450 s
# allow (an H200's table, else the tests and one A/B); PART=fit ~500 s (the tests first,
# then as short); PART=mini ~190 s of it; PART=exp
# the GPU tests and the open A/B experiments (NOTES.md, twentieth section's end); PART=start
# a session's first call (~300 s): on an H200 its headline rows with torch.compile, else the
# GPU tests, the MLM step's host stages and its kernels (twenty-sixth session); PART=check a
# change's call: the GPU tests, an in-process A/B against ab_$AB_OLD, fused_ce's time and memory
# at the BERT shapes and the MLM host stages (twenty-seventh). PART=graphs captured steps
# (thirtieth). PART=rowref the row-reference option (thirty-fourth); PART=rowref_on with it on
# for wide heads, PART=lowmem low_memory's one sweep (thirty-fifth); PART=gradlogits_tests,
# PART=gradlogits_ab, PART=lowmem_profile the sweeps' logits kernel and the one sweep, PART=next
# the next session's first call (thirty-sixth).
# The card's name goes to device.txt: an H100's numbers compare methods within the call only.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu, $(date -u +%FT%TZ)" | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  | tee -a "$OUT/device.txt"
bert() { STEPS=bench BENCH_TIMEOUT=${1:-420} \
    BENCH_SHAPES=bert8k,mlm,bert16k,logsoftmax,bert16k_eval,mlm_eval \
    BENCH_METHODS=fused_ce,fused_ce_lowmem,${2-eager,}compile,liger,floor bash tools/gpu_steps.sh; }
large() { STEPS=large LARGE_TIMEOUT=${1:-560} REP_MS=${2:-1000} \
    LARGE_SHAPES=llama3,gemma2,llama3_eval,gemma2_eval \
    LARGE_METHODS=fused_ce,fused_ce_lowmem,compile,liger,cce,floor bash tools/gpu_steps.sh; }
tests() { STEPS=tests bash tools/gpu_steps.sh; }
# the wide heads' bench step within $1 s, $2 ms of repetitions, shapes $3, methods $4, its log
# kept as $5.log
wide() { STEPS=large LARGE_TIMEOUT=$1 REP_MS=$2 LARGE_SHAPES=$3 LARGE_METHODS=$4 \
    bash tools/gpu_steps.sh; cp "$OUT/large.log" "$OUT/$5.log"; }
# the H200's rows: BERT shapes within $1 s, with eager (7-14 ms a step); the wide heads $3
# within $2 s, without eager (its logits take 12 GB). Without eager, Cut CE and the eval rows
# of MLM and Gemma-2, PART=short took 124 s in the thirty-first session
h200_rows() { STEPS=bench BENCH_TIMEOUT=$1 \
    BENCH_SHAPES=bert8k,mlm,bert16k,logsoftmax,bert16k_eval,mlm_eval \
    BENCH_METHODS=fused_ce,fused_ce_lowmem,eager,compile,liger,floor bash tools/gpu_steps.sh
  STEPS=large LARGE_TIMEOUT=$2 LARGE_SHAPES=$3 LARGE_METHODS=fused_ce,compile,liger,cce,floor \
    bash tools/gpu_steps.sh; }
# the statistics pass's stages per regime (the default: 4 at BERT's head, 3 at wide ones, NOTES.md
# #65) against 3 everywhere, $1 rounds
stats_stages_ab() { STEPS=tiles_cfg TILES_ROUNDS=$1 TILES_SHAPES=bert16k_eval,llama3_eval \
    TILES_CFGS='{};{"stats_stages": 3}' bash tools/gpu_steps.sh; }
# GPU tests of tests/test_gpu.py matching $2 within $1 s, the tail kept as $3.log
gpu_tests_k() { HF_HUB_OFFLINE=1 timeout $1 python3 -m pytest -q -p no:cacheprovider \
    tests/test_gpu.py -k "$2" 2>&1 | grep -v Warn | tail -4 | tee "$OUT/$3.log"; }
# low_memory (or AB_METHODS) in this tree and ab_prev, new prev new prev (the floor in the
# first round), each run within $1 s at AB_SHAPES (default $2), kept as $3.log
lowmem_ab() { r=0; for v in new prev new prev; do d=.; [ $v = prev ] && d=ab_prev
    m=${AB_METHODS:-fused_ce_lowmem}; r=$((r + 1)); [ $r = 1 ] && m=$m,floor; echo "== $v"
    timeout $1 python3 $d/benchmarks/bench.py --out /tmp/ab --rep-ms 200 --warmup-ms 50 \
      --warmup-steps 2 --shapes ${AB_SHAPES:-$2} --methods $m 2>&1 \
      | grep -E "^(llama3|gemma2|bert8k|bert16k|mlm|qwen05b) " | sort -u; done \
    | tee "$OUT/$3.log"; }
SWEEP_TESTS="low_memory or one_sweep or sweep or scaled or upstream or capture"
case ${PART:-table} in
table) bert 290; large 270 ;;
all) tests; bert 230 ""; large 200 600 ;;
bert) bert ;;
large) large ;;
short) case "$gpu" in  # what ~450 s allow: the H200's table, or the tests
    *H200*) h200_rows 230 200 llama3,gemma2,llama3_eval,gemma2_eval ;;
    *) tests; stats_stages_ab 2 ;;
    esac ;;
fit) case "$gpu" in  # ~500 s: the GPU tests, then the H200's table (less the wide heads' eval rows)
    *H200*) tests; h200_rows 170 150 llama3,gemma2 ;;
    *) tests; stats_stages_ab 1 ;;
    esac ;;
start) case "$gpu" in
    *H200*) STEPS=bench BENCH_TIMEOUT=200 BENCH_SHAPES=bert8k,mlm,bert16k,mlm_eval \
        BENCH_METHODS=fused_ce,compile,floor bash tools/gpu_steps.sh ;;
    *) tests
      PYTHONPATH=/tmp/site:. timeout 90 python3 tools/host_stages.py --shapes mlm 2>&1 \
        | grep -v Warn | tee "$OUT/host_stages.log" | tail -45
      PYTHONPATH=/tmp/site:. timeout 60 python3 tools/profile_kernels.py --shapes mlm \
        --methods fused_ce --rows 30 2>&1 | grep -v Warn | tee "$OUT/profile.log" ;;
    esac ;;
check) tests  # a change's call (~400 s): GPU tests, in-process A/B against ab_$AB_OLD, memory
    STEPS=ab_inproc AB_SHAPES=${AB_SHAPES:-mlm,mlm_eval,bert8k} bash tools/gpu_steps.sh
    STEPS=bench BENCH_TIMEOUT=150 BENCH_SHAPES=mlm,mlm_eval,bert8k,bert16k \
      BENCH_METHODS=fused_ce,floor bash tools/gpu_steps.sh
    PYTHONPATH=/tmp/site:. timeout 90 python3 tools/host_stages.py --shapes mlm 2>&1 \
      | grep -v Warn > "$OUT/host_stages.log"; grep -A40 "=== mlm" "$OUT/host_stages.log" ;;
chunks)  # the row-chunk workspace against time at the BERT shapes (twenty-seventh)
    STEPS=tiles_cfg TILES_ROUNDS=2 TILES_SHAPES=bert8k,bert16k,mlm TILES_CFGS='{"config.ROW_CHUNK_SPLIT_MIN_ROWS": 99999, "config.OVERLAP_MIN_CHUNKS": 2};{"config.ROW_CHUNK_SPLIT_MIN_ROWS": 1, "overlap": false};{"config.ROW_CHUNK_SPLIT_MIN_ROWS": 1, "config.ROW_CHUNK_BYTES": 134217728, "config.ROW_CHUNKS_FEW": 8};{"config.ROW_CHUNK_SPLIT_MIN_ROWS": 1, "config.ROW_CHUNK_BYTES": 134217728, "config.ROW_CHUNKS_FEW": 8, "overlap": false}' \
      bash tools/gpu_steps.sh ;;
mini) case "$gpu" in  # ~250 s: the H200's headline rows, or the GPU tests
    *H200*) STEPS=bench BENCH_TIMEOUT=120 BENCH_SHAPES=bert8k,mlm,bert16k \
        BENCH_METHODS=fused_ce,compile,floor bash tools/gpu_steps.sh
      STEPS=large LARGE_TIMEOUT=60 LARGE_SHAPES=llama3 LARGE_METHODS=fused_ce,compile,floor \
        bash tools/gpu_steps.sh ;;
    *) tests ;;
    esac ;;
graphs)  # ~200 s: captured steps (thirtieth session, #91): fused_ce and torch.compile under
    # mode="reduce-overhead" beside eager mode at the BERT shapes, each graph method's memory
    # from its own process, and the torch.cuda.graph probe with the vocabulary sweeps
    STEPS=bench BENCH_TIMEOUT=200 REP_MS=300 BENCH_SHAPES=bert8k,mlm,bert16k \
      BENCH_METHODS=fused_ce,fused_ce_graphs,compile,compile_graphs,floor bash tools/gpu_steps.sh
    for s in bert8k mlm bert16k; do for m in fused_ce_graphs compile_graphs; do
      timeout 60 python3 benchmarks/bench.py --out /tmp/g --rep-ms 300 --warmup-ms 50 \
        --shapes $s --methods $m 2>&1 | grep -E "^$s " | tail -1; done; done \
      | tee "$OUT/graphs_own_process.log"
    timeout 150 python3 tools/probe_capture.py --shapes bert8k,mlm,bert16k --no-compile 2>&1 \
      | grep -v Warn | tee "$OUT/capture.log" ;;
exp) tests; stats_stages_ab 1
    STEPS=tiles_cfg TILES_ROUNDS=1 TILES_SHAPES=llama3,gemma2 TILES_CFGS='{};{"overlap": true}' \
    bash tools/gpu_steps.sh ;;
rowref)  # ~550 s (thirty-fourth session): the row-reference option (NOTES.md #95-#98), most
    # wanted first (a call cut short keeps what it wrote): its GPU tests; an A/B against the D
    # pass, also with Zipf-drawn targets (AB_SHAPES); the error probe; on an H200 the wide
    # heads with their peers, on another card a second A/B; the profile at Gemma-2. SHORT=1:
    # the tests and one A/B only
    HF_HUB_OFFLINE=1 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "row_ref or captured" 2>&1 | grep -v Warn | tail -15 | tee "$OUT/tests_rowref.log"
    ab() { wide 150 300 "${AB_SHAPES:-gemma2,gemma2_zipf,llama3}" \
      fused_ce_rowref,fused_ce_dpass ab$1; }
    ab 1
    [ -n "$SHORT" ] && exit 0
    timeout 80 python3 tools/probe_row_ref.py 2>&1 | grep -v Warn | tee "$OUT/probe_row_ref.log"
    case "$gpu" in
      *H200*) wide 170 300 gemma2,llama3 fused_ce_rowref,fused_ce,compile,liger,floor peers ;;
      *) ab 2 ;;
    esac
    PYTHONPATH=/tmp/site:. timeout 100 python3 tools/profile_kernels.py --shapes gemma2 \
      --methods fused_ce_dpass,fused_ce_rowref --rows 8 2>&1 | grep -v Warn > "$OUT/profile.log"
    grep -A9 "^===" "$OUT/profile.log" ;;
rowref_on)  # ~560 s (thirty-fifth session, NOTES.md #99-#100): row references on for wide heads;
    # on an H200 the wide heads with their peers first (the table), then the A/B at a
    # small LM's head (the GPU configuration, where row_ref was still off then), then all GPU
    # tests; on another card the tests first
    table() { wide 200 400 gemma2,llama3 fused_ce,fused_ce_dpass,compile,liger,floor table; }
    small() { wide 100 300 qwen05b fused_ce_rowref,fused_ce_dpass,compile,liger,floor small; }
    case "$gpu" in
      *H200*) table; small; tests ;;
      *) tests; small; table ;;
    esac ;;
next)  # the thirty-seventh session's first call (~450 s): the wide heads' table with row
    # references on (on an H200; elsewhere skipped), then low_memory's rows after NOTES.md
    # #102/#103 with Liger and the floor beside it
    case "$gpu" in
      *H200*) wide 170 400 gemma2,llama3 fused_ce,compile,liger,floor table ;;
    esac
    wide 150 300 llama3,gemma2 fused_ce_lowmem,liger,floor lowmem_wide
    STEPS=bench BENCH_TIMEOUT=100 BENCH_SHAPES=bert8k,mlm,bert16k \
      BENCH_METHODS=fused_ce_lowmem,floor bash tools/gpu_steps.sh ;;
s37)  # the thirty-seventh session's first call (~350 s, ~520 on an H200): on an H200 the
    # wide heads' table with their peers; the GPU tests of the sweeps' rounding (NOTES.md #104:
    # scale.scale_to then, scale_into's outs now), then low_memory at the wide heads in this
    # tree and ab_prev (beeebfd: mkdir ab_prev && git archive beeebfd fused_ce
    # benchmarks/bench.py | tar -x -C ab_prev), new prev new prev, the floor in the first round
    case "$gpu" in
      *H200*) wide 170 400 gemma2,llama3 fused_ce,compile,liger,floor table ;;
    esac
    gpu_tests_k 150 "scaled_grads or one_sweep or low_memory" tests_s37
    lowmem_ab 85 llama3,gemma2 ab_s37 ;;
half_acc)  # ~350 s (thirty-seventh session, NOTES.md #107): the GPU tests of the sweeps, then
    # low_memory in this tree and ab_prev (5590589: mkdir ab_prev && git archive 5590589
    # fused_ce benchmarks/bench.py | tar -x -C ab_prev), new prev new prev, wide heads and BERT
    gpu_tests_k 170 "$SWEEP_TESTS" tests_half_acc
    lowmem_ab 70 llama3,gemma2,bert8k ab_half_acc ;;
final37)  # the thirty-seventh session's last calls (~450 s each). On an H200: the wide heads'
    # rows and BERT's with their peers and low_memory (the README's table; PART=tests in a
    # second call); elsewhere the GPU tests, then the same rows without Liger at BERT's heads
    case "$gpu" in
      *H200*) wide 230 300 gemma2,llama3 fused_ce,fused_ce_lowmem,compile,liger,cce,floor wide
        STEPS=bench BENCH_TIMEOUT=200 \
          BENCH_SHAPES=bert8k,mlm,bert16k,logsoftmax,bert16k_eval,mlm_eval \
          BENCH_METHODS=fused_ce,fused_ce_lowmem,compile,liger,floor bash tools/gpu_steps.sh ;;
      *) tests; wide 170 300 gemma2,llama3 fused_ce,fused_ce_lowmem,compile,liger,floor wide
        STEPS=bench BENCH_TIMEOUT=90 BENCH_SHAPES=bert8k,mlm,bert16k \
          BENCH_METHODS=fused_ce,fused_ce_lowmem,compile,floor bash tools/gpu_steps.sh ;;
    esac ;;
final37b)  # ~420 s: all the GPU tests, then the wide heads with their peers and low_memory
    tests; wide 170 300 gemma2,llama3 fused_ce,fused_ce_lowmem,compile,liger,floor wide ;;
tests) tests ;;
trade40)  # ~90 s (fortieth session, RESULTS.md AL): fused_ce and torch.compile alternating
    # three times in one process at the wide heads (which of the two is ahead at Llama-3's head
    # changed from call to call on the H100, RESULTS.md AH-AK), no error columns
    for sh in llama3 gemma2; do PYTHONPATH=/tmp/site timeout 200 python3 benchmarks/bench.py \
        --out /tmp/trade --rep-ms 1000 --warmup-steps 3 --no-errors --shapes $sh \
        --methods fused_ce,compile,fused_ce,compile,fused_ce,compile,floor 2>&1 \
        | grep -E "^(llama3|gemma2) " | awk '!seen[$0]++'; done | tee "$OUT/trade40.log" ;;
prepared41)  # ~90 s (NOTES.md #110's test): fused_ce with and without its targets prepared
    # before the timed steps, and torch.compile, ten steps back to back, four rounds alternating
    timeout 240 python3 tools/steps_back_to_back.py --shapes llama3,gemma2 \
      --methods fused_ce,fused_ce_prepared,compile --rounds 4 --steps 10 2>&1 \
      | grep -E "^(llama3|gemma2) " | tee "$OUT/prepared41.log" ;;
s41b)  # ~400 s, for a session's last device minutes: the GPU tests, then on an H200 the wide
    # heads beside torch.compile (their H200 rows on current code), elsewhere clocks41
    tests
    case "$gpu" in
      *H200*) wide 150 300 gemma2,llama3 fused_ce,compile,floor wide ;;
      *) PART=clocks41 bash tools/device_plan.sh ;;
    esac ;;
clocks41)  # ~100 s (forty-first session, NOTES.md #110): fused_ce and torch.compile back to
    # back, four rounds alternating, with each method's mean SM clock and power draw over its
    # timed runs (nvidia-smi every 50 ms): whether fused_ce's per-step time above its GPU busy
    # time is clocks
    nvidia-smi --query-gpu=power.limit,clocks.max.sm --format=csv | tee "$OUT/clocks41.log"
    timeout 240 python3 tools/steps_back_to_back.py --shapes llama3,gemma2 \
      --methods fused_ce,compile --rounds 4 --steps 10 --clocks 2>&1 \
      | grep -E "^(llama3|gemma2) " | tee -a "$OUT/clocks41.log" ;;
next38)  # the next session's first call (~450 s): on an H200 the README's table (final37's
    # rows); elsewhere #108's A/B (dbytes), then the wide heads with their peers
    case "$gpu" in
      *H200*) PART=final37 bash tools/device_plan.sh ;;
      *) PART=dbytes bash tools/device_plan.sh
        wide 150 300 gemma2,llama3 fused_ce,fused_ce_lowmem,compile,liger,floor wide ;;
    esac ;;
dbytes)  # ~200 s (thirty-eighth session): low_memory with D_BYTES_LOW_MEMORY 8 (then the
    # default), 12 and 14 MiB (fewer dW chunks: fewer launches where it is launch-bound),
    # BERT's heads twice, then the wide heads once (DB_SIZES, DB_ROUNDS, DB_SHAPES, DB_WIDE=0:
    # fewer); NOTES.md #108 adopted 12 from it and tools/ab_in_process.py --low-memory
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      >/dev/null 2>&1
    db() { echo "== D_BYTES_LOW_MEMORY $1 MiB, $2"; PYTHONPATH=/tmp/site timeout 100 python3 \
      tools/bench_tiles_config.py "{\"config.D_BYTES_LOW_MEMORY\": $(($1 * 1048576))}" \
      --out /tmp/ab --rep-ms 200 --warmup-ms 50 --warmup-steps 2 --shapes $2 \
      --methods fused_ce_lowmem 2>&1 | grep -E "^(llama3|gemma2|bert8k|bert16k|mlm) " | sort -u; }
    { for r in $(seq ${DB_ROUNDS:-2}); do for d in ${DB_SIZES:-8 12 14}; do
        db $d ${DB_SHAPES:-bert8k,mlm,bert16k}; done; done
      [ "${DB_WIDE:-1}" = 1 ] && for d in 8 14; do db $d gemma2,llama3; done; } \
      | tee "$OUT/dbytes.log" ;;
s38)  # ~460 s (thirty-eighth session, one call left after failed starts): all the GPU tests,
    # then the wide heads with their peers and low_memory (on an H200 with Cut CE too)
    tests; m=fused_ce,fused_ce_lowmem,compile,liger,floor; t=150
    case "$gpu" in *H200*) m=$m,cce; t=200 ;; esac
    wide $t 300 gemma2,llama3 $m wide ;;
host_alpha)  # ~300 s (thirty-seventh session, NOTES.md #105): the GPU tests of the sweeps,
    # low_memory at the wide heads in this tree and ab_prev (the tree before #105: mkdir
    # ab_prev && git archive e8ec71e fused_ce benchmarks/bench.py | tar -x -C ab_prev), new
    # prev new prev, then its kernels
    gpu_tests_k 150 "$SWEEP_TESTS" tests_alpha
    lowmem_ab 85 llama3,gemma2 ab_alpha
    PROFILE_METHODS=fused_ce_lowmem PART=lowmem_profile bash tools/device_plan.sh ;;
gl_tune)  # ~200 s (thirty-seventh session): low_memory's kernels at the wide heads under
    # grad_logits tile variants (tools/bench_tiles_config.py around tools/profile_kernels.py),
    # GL_CFGS: JSON objects separated by ';'
    IFS=';'; for c in ${GL_CFGS:-'{}'}; do unset IFS; echo "== $c"
      timeout 90 python3 tools/bench_tiles_config.py "$c" tools/profile_kernels.py \
        --shapes ${GL_SHAPES:-llama3,gemma2} --methods fused_ce_lowmem --rows 14 2>&1 \
        | grep -E "^===|grad_logits|logits_tiles|scale_kernel|elementwise|badd|Error|error" \
        | grep -v Warn; done | tee "$OUT/gl_tune.log"; unset IFS ;;
lowmem)  # ~300 s (thirty-fifth session, NOTES.md #100, #101): the GPU tests of low_memory
    # and the row references; low_memory in one sweep against the row blocks and row references
    # against the D pass, then a second round of the former
    HF_HUB_OFFLINE=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "low_memory or one_sweep or row_ref" 2>&1 | grep -v Warn | tail -5 \
      | tee "$OUT/tests_lowmem.log"
    ab() { wide $1 300 "${AB_SHAPES:-llama3,gemma2,qwen05b}" $2 ab_lowmem$3; }
    ab 150 fused_ce_lowmem_one_sweep,fused_ce_lowmem_blocks,fused_ce,fused_ce_dpass,floor 1
    ab 90 fused_ce_lowmem_blocks,fused_ce_lowmem_one_sweep 2
    [ -n "$PROFILE" ] && PART=lowmem_profile bash tools/device_plan.sh ;;
gradlogits_tests)  # ~200 s (thirty-sixth session): the GPU tests with grad_logits' descriptors,
    # halves and grouped order (the sweeps: low_memory, capture)
    HF_HUB_OFFLINE=1 timeout 220 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 \
      | grep -v Warn | tail -8 | tee "$OUT/tests_gradlogits.log" ;;
gradlogits_ab)  # ~300 s: low_memory by the row blocks (its default) and in one sweep, in this tree
    # and ab_prev (d5099e2: grad_logits one tile a program), and the row blocks in ab_old
    # (b831194: grad_logits before its descriptors; mkdir ab_old && git archive b831194 | tar
    # -x -C ab_old), new prev old new
    for v in new prev old new; do d=.; m=fused_ce_lowmem_one_sweep,fused_ce_lowmem
      [ $v != new ] && d=ab_$v; [ $v = old ] && m=fused_ce_lowmem; echo "== $v"
      timeout 80 python3 $d/benchmarks/bench.py --out /tmp/ab --rep-ms 200 --warmup-ms 50 \
        --warmup-steps 2 --shapes ${AB_SHAPES:-llama3,gemma2} --methods $m 2>&1 \
        | grep -E "^(llama3|gemma2|bert8k|bert16k|mlm|qwen05b) " | sort -u; done \
      | tee "$OUT/ab_gradlogits.log"
    PROFILE_METHODS=fused_ce_lowmem_one_sweep,fused_ce_lowmem PART=lowmem_profile \
      bash tools/device_plan.sh ;;
s42)  # ~500 s on an H200, ~210 s elsewhere: the GPU tests (two new ones from the forty-second
    # session's fuzz fixes), the softcap tanh probe on CUDA (NOTES.md #112), then on an H200 the
    # wide heads' rows with their peers (final37's), elsewhere clocks41 (#110)
    tests
    PYTHONPATH=. timeout 60 python3 tools/probe_softcap_tanh.py --device cuda 2>&1 | grep "^cap" \
      | tee "$OUT/softcap_tanh.log"
    case "$gpu" in
      *H200*) wide 230 300 gemma2,llama3 fused_ce,fused_ce_lowmem,compile,liger,cce,floor wide ;;
      *) PART=clocks41 bash tools/device_plan.sh ;;
    esac ;;
s43)  # ~450 s (forty-third session, NOTES.md #112): the GPU tests (the softcap tanh's among
    # them), the softcap probe on CUDA, then fused_ce and low_memory at Gemma-2's softcapped
    # head in this tree and ab_prev (7a2ef27, tanh before its Taylor branch: mkdir ab_prev &&
    # git archive 7a2ef27 fused_ce benchmarks/bench.py | tar -x -C ab_prev), new prev new prev
    tests
    PYTHONPATH=. timeout 60 python3 tools/probe_softcap_tanh.py --device cuda 2>&1 | grep "^cap" \
      | tee "$OUT/softcap_tanh.log"
    AB_METHODS=fused_ce,fused_ce_lowmem lowmem_ab 70 gemma2 ab_tanh ;;
s43b)  # ~300 s, s43 for a short budget: the GPU tests with a softcap, then its A/B
    gpu_tests_k 120 "softcap or tanh" tests_softcap
    AB_METHODS=fused_ce,fused_ce_lowmem lowmem_ab 55 gemma2 ab_tanh ;;
lowmem_profile)  # ~80 s: where low_memory's time goes at the wide heads, kernel by kernel
    timeout 120 python3 tools/profile_kernels.py --shapes llama3,gemma2 \
      --methods ${PROFILE_METHODS:-fused_ce_lowmem_one_sweep,fused_ce_lowmem_blocks} 2>&1 \
      | grep -v Warn | tee "$OUT/profile_lowmem.log" ;;
esac
