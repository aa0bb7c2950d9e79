#!/usr/bin/env bash
# One batched H200 call of the open GPU work, steps chosen on the command line (run on the device with
# `carry: [".gpu"]`); each step has its own time limit, logs and results go to $OUT/w, tarred into
# $OUT/session.tgz at the end (one file back). Steps run in the order given:
#   nosync        what has not run on a GPU yet: tests/gpu/test_plan_no_sync.py (plan() under torch's sync
#                 debug mode "error"), tests/gpu/test_cascade_gpu.py (the cascade planner's one packed
#                 copy), tests/core/test_staging.py (~2 min)
#   soak          the 10,000 plan/run cycles alone on the machine (~15 ms a cycle: ~3 min), up to 7 min
#   fa3           the fa3 provider against the reference on the GPU: tests/gpu/test_providers_gpu.py and
#                 tests/core/test_fa3_tree.py, -k fa3 (the eager block table gathered on the device) (~1 min)
#   cascade-if    tests/core/test_cascade_graph.py (triton + real FA3, IF-node test included), then the
#                 cascade graph bench with ATTNPLUG_GRAPH_IF=1 and =0 (the anchor) (~3 min); IF=1 needs a
#                 torch with CUDA-graph IF nodes (2.11 has none: that bench is then refused)
#   sweep         benchmarks/sweep_triton.py --write (~3 min)
#   bench-prefill the prefill / extend rows, triton vs fa3 vs flashinfer, after the sweep (~2 min)
#   sweep-long    the sweep of the long-context decode buckets only (1x32768 rows of every head dim, fp8
#                 4x32768), with the wider split candidates, --write (~2 min)
#   bench-long    decode 1x32768 / 4x32768 / 64x4096 rows, bf16 and fp8, triton vs fa3 (~2 min)
#   fp8-fi        FlashInfer JIT warm-up (cold: > 200 s on the H200), then tests/gpu/test_fp8_gpu.py -k flashinfer (~6 min)
#   decode-graph  benchmarks/probes/decode_graph_bench.py, triton and fa3: decode graphs captured for 32768 keys,
#                 replayed at 1x1024 / 64x1024, bf16 vs fp8, pages 1 and 16, plus the KV write; each provider also
#                 captured for 1024 keys ('PROVIDER@1024': the split count of the replayed length) (~3 min)
#   sweep-shared  benchmarks/sweep_triton.py (no --write) on the unsplit decode rows: the shared-prefix row
#                 with cascade off (64 x (8192 shared + 256)), its unshared twin, 64x4096, 128x2048 (~3 min)
#   decode-graph-fi  the same for the flashinfer provider (scale tensors, and 'flashinfer+host': host-float
#                 scales) and FlashInfer's own wrapper (after fp8-fi's warm-up on the same machine; a cold JIT
#                 can take minutes)
#   bench-shared  python -m attnplug.bench, the shared-prefix row (cascade on and off) and its unshared twin,
#                 triton / flashinfer / fa3 (FlashInfer's cascade wrapper as the anchor) (~2 min)
#   bench-graphs  the decode rows 1x32768 / 4x32768 / 64x4096 (bf16, fp8), eager and with --cuda-graphs (every
#                 implementation replayed from one CUDA graph), triton / flashinfer / fa3, after the FlashInfer JIT
#                 of those rows (~6 min)
#   fp8-host      tests/gpu/test_fp8_gpu.py -k host_scales (every provider, eager and graphs) (~1 min)
#   ncu           benchmarks/probes/ncu_probe.py under Nsight Compute (speed of light, memory, warp stalls,
#                 occupancy): one forward of the triton provider's decode rows (64x4096, 1x32768, 4x32768,
#                 bf16 and fp8) and of the shared-prefix row with cascade (each part's kernel) (~3 min)
#   sweep-fp8     benchmarks/sweep_triton.py --write on the fp8 decode rows 64x4096, 1x32768, 4x32768 (the
#                 full-batch candidates: fewer warps, splits; the byte-pair reads) (~3.5 min)
#   fp8-triton    tests/gpu/test_fp8_gpu.py -k triton (the table's fp8 entries: byte pairs, eager and graphs)
#   bench-fp8     the bench-graphs rows, triton and fa3 only, --cuda-graphs (no FlashInfer JIT) (~1.5 min)
#   fast-fp8      tests/core/test_fast_kernels.py -k "fp8 or pairs or full_batch" compiled (the byte pairs' inline asm)
#   graphs-only   the bench-graphs rows with --cuda-graphs only (after the FlashInfer JIT of those rows)
#   cascade-tf    the cascade on the GPU: tests/gpu/test_cascade_gpu.py, tests/core/test_cascade_graph.py and the
#                 merge kernels' tests (tests/core/test_kernel_paths.py -k merge), then the shared-prefix row and its
#                 unshared twin, triton and fa3 only (no FlashInfer JIT), eager and graphs (~4 min)
#   shared-tf     cascade-tf's bench alone (no tests)
#   sweep-prefix  benchmarks/sweep_cascade_prefix.py --write: the noncausal entry (the cascade's prefix part) timed as
#                 graph replays on the shared-prefix row (~3 min); the table comes back as w/sweep-prefix/tiles.py
#   sweep-suffix  tests/core/test_cascade_graph.py, then benchmarks/probes/sweep_cascade_suffix.py: decode entries as the
#                 cascade graph's suffix part and the plain decode graphs run them (~4 min)
#   probe-unshared  benchmarks/probes/cascade_unshared_probe.py: the cascade graph's parts captured alone on the
#                 shared row and its unshared twin, triton and fa3 (fa3: its library call with / without the LSE) (~1 min)
#   sweep-prefill benchmarks/sweep_triton.py --write on the d128 prefill rows (4x4096, 1x8192, extend, page 64), then
#                 the prefill rows triton vs fa3 with the written table (~5 min); the table comes back as w/sweep-prefill/tiles.py
#   sweep-prefix64  sweep-prefix over the table's entry and the 64-row candidates only (--block-m 64) (~2 min)
#   cg-short      benchmarks/probes/cascade_graph_bench.py --graphs-only on the rows that share nothing (2-64 requests x
#                 (768 + 256), 8 / 64 x (8192 + 256)), triton and fa3: what cascade graphs cost where nothing is shared (~2 min)
#   plan-cost     benchmarks/probes/plan_cost.py --device cuda alone (triton, fa3; the host's load recorded in its JSON) (~1 min)
#   paths-plan    tests/core/test_staging.py, tests/gpu/test_plan_no_sync.py, tests/core/test_kernel_paths.py,
#                 tests/gpu/test_providers_gpu.py (not flashinfer), then benchmarks/probes/plan_cost.py --device cuda,
#                 triton and fa3 (~4 min)
#   sweep-deep    benchmarks/sweep_triton.py --write --deep: the d128 decode rows (bf16 and fp8: 1x32768, 4x32768,
#                 64x4096; bf16 128x2048) with deeper pipelines only (~3.5 min); the table comes back as w/sweep-deep/tiles.py
#   bench-layout  the decode rows 64x4096 / 128x2048 (bf16, fp8) and 64x4096 in the HND layout (bf16, fp8: what vLLM
#                 gives attnplug_triton for an fp8 cache), triton and fa3, --cuda-graphs (~2 min); with
#                 SWEEP_FP8_ROWS="64x4096 fp8,128x2048 fp8" sweep-fp8 first: the full-batch fp8 entry over both batch sizes
#   mask-plan     tests/gpu/test_plan_no_sync.py and the verify / mask cases of tests/gpu/test_providers_gpu.py
#                 (not flashinfer): a large host tree mask in the plan's packed copy (~1.5 min)
#   wave-tests    the GPU tests of issues 40-46 that have never run on a GPU: sinks (all providers, bf16 and
#                 float32 sinks), the FlashInfer workspace count, MLA, chain verify, cascade (incl. launch counts),
#                 Gluon (ATTNPLUG_GLUON=1) (~4 min)
#   gluon         benchmarks/probes/gluon_prefill_probe.py: the Gluon prefill against the Triton kernel and FA3 (~2 min)
#   cascade43     benchmarks/probes/cascade_unshared_bench.py: cascade-on vs cascade-off graphs where nothing is shared,
#                 triton and fa3 (~2 min)
#   gluon-quick   the gluon probe without its configuration sweep (~1.5 min)
#   suite         pytest tests/gpu tests/core -k "not flashinfer" (xdist -n 8 through gpu_run.sh), SUITE_S seconds (300)
#   sinks-memcheck  tests/core/test_sinks.py (not flashinfer) under compute-sanitizer memcheck, one process (~3 min)
#   mla-h128      benchmarks/probes/mla_sweep.py --rows h128: the 128-head MLA decode tiles (~2 min)
#   mla           python -m attnplug.bench --rows MLA: the three MLA providers against FlashMLA / FlashInfer (~2 min)
#   e.g.  bash scripts/gpu_session_call.sh nosync cascade-if sweep bench-prefill
set -u
W=$OUT/w; mkdir -p "$W"; G="bash scripts/gpu_run.sh"; t0=$SECONDS
# cut short (e.g. `timeout 580 bash scripts/gpu_session_call.sh ...` inside the call's limit): what ran comes back
trap 'tar czf "$OUT/session.tgz" -C "$OUT" w; exit 124' TERM
log() { echo "$* at $((SECONDS - t0))s" | tee -a "$W/rc"; }
$G true > "$W/install.log" 2>&1
# a FlashInfer JIT cut by its timeout leaves its compilers running (timeout ends only its child): stop
# them before anything is timed
reap() { pkill -f 'ninja|nvcc|cicc|ptxas' || true; sleep 1; }
CG_ROWS="64x(8192 shared,64x(768,8x(8192 +"
for step in "$@"; do
  case $step in
  nosync)
    timeout 180 $G python3 -m pytest tests/gpu/test_plan_no_sync.py tests/gpu/test_cascade_gpu.py tests/core/test_staging.py \
      -q -rfEs > "$W/pytest-nosync.log" 2>&1; log "pytest nosync rc $?"; tail -n 3 "$W/pytest-nosync.log" ;;
  soak)
    timeout 440 $G python3 -m attnplug.bench.soak --device cuda --phases plan_run --time-budget 400 \
      --out "$W/soak-h200-plan-run.json" > "$W/soak-plan.log" 2>&1; log "soak plan_run rc $?"
    grep -h "plan_run" "$W/soak-plan.log" | tail -n 2 ;;
  fa3)
    timeout 120 $G python3 -m pytest tests/gpu/test_providers_gpu.py tests/core/test_fa3_tree.py -q -rfEs -k fa3 \
      > "$W/pytest-fa3.log" 2>&1; log "pytest fa3 rc $?"; tail -n 3 "$W/pytest-fa3.log" ;;
  cascade-if)
    timeout 120 $G python3 -m pytest tests/core/test_cascade_graph.py -q -rfEs > "$W/pytest-cascade-graph.log" 2>&1
    log "pytest cascade graph rc $?"; tail -n 3 "$W/pytest-cascade-graph.log"
    for v in 1 0; do
      ATTNPLUG_GRAPH_IF=$v timeout 90 $G python3 benchmarks/probes/cascade_graph_bench.py --graphs-only --only "$CG_ROWS" \
        --out "$W/cg-if$v" > "$W/cg-if$v.log" 2>&1; log "cascade bench GRAPH_IF=$v rc $?"
    done ;;
  sweep)
    timeout 260 $G python3 benchmarks/sweep_triton.py --write --budget 200 --out "$W/sweep" > "$W/sweep.log" 2>&1
    log "sweep rc $?"; tail -n 5 "$W/sweep.log" ;;
  sweep-long)
    timeout 200 $G python3 benchmarks/sweep_triton.py --write --budget 150 --rows "1x32768,4x32768 fp8" \
      --out "$W/sweep-long" > "$W/sweep-long.log" 2>&1; log "sweep-long rc $?"; grep "^sweep:" "$W/sweep-long.log" | tail -n 12 ;;
  bench-long)
    timeout 170 $G python3 -m attnplug.bench --providers triton,fa3 --rows 32768,64x4096 --out "$W/bench-long" \
      --time-budget 140 > "$W/bench-long.log" 2>&1; log "bench-long rc $?" ;;
  bench-prefill)
    reap
    timeout 150 $G python3 -m attnplug.bench --providers triton,flashinfer,fa3 --rows prefill --out "$W/bench-prefill" \
      --time-budget 120 > "$W/bench-prefill.log" 2>&1; log "bench prefill rc $?" ;;
  fp8-fi)
    timeout 300 $G python3 -m attnplug.bench.jit_warmup > "$W/warm.log" 2>&1; log "jit warm-up rc $?"; reap
    timeout 150 $G python3 -m pytest tests/gpu/test_fp8_gpu.py -q -rfEs -k flashinfer > "$W/pytest-fi-fp8.log" 2>&1
    log "pytest fi fp8 rc $?"; tail -n 3 "$W/pytest-fi-fp8.log" ;;
  decode-graph)
    timeout 200 $G python3 benchmarks/probes/decode_graph_bench.py --providers triton,fa3 --capture-len 32768,1024 --out "$W/decode-graph" \
      > "$W/decode-graph.log" 2>&1; log "decode graph bench rc $?"; grep "^decode" "$W/decode-graph.log" | cut -c1-300 ;;
  sweep-shared)
    timeout 220 $G python3 benchmarks/sweep_triton.py --budget 170 --rows '64x(8192,64x4096$,128x2048$' \
      --out "$W/sweep-shared" > "$W/sweep-shared.log" 2>&1; log "sweep-shared rc $?"; grep "^sweep:" "$W/sweep-shared.log" | tail -n 12 ;;
  decode-graph-fi)
    reap
    timeout 240 $G python3 benchmarks/probes/decode_graph_bench.py --providers flashinfer,flashinfer+host --capture-len 32768 --out "$W/decode-graph-fi" \
      > "$W/decode-graph-fi.log" 2>&1; log "decode graph bench (flashinfer) rc $?"; grep "^decode" "$W/decode-graph-fi.log" | cut -c1-300 ;;
  bench-shared)
    reap
    timeout 150 $G python3 -m attnplug.bench --providers triton,flashinfer,fa3 --rows '64x(8192+256)' --out "$W/bench-shared" \
      --time-budget 120 > "$W/bench-shared.log" 2>&1; log "bench shared rc $?" ;;
  bench-graphs)
    reap
    R='decode 1x32768$,decode 1x32768 fp8$,decode 4x32768$,decode 64x4096$,decode 64x4096 fp8$'
    timeout 170 $G python3 -m attnplug.bench.jit_warmup --bench > "$W/warm-bench.log" 2>&1; log "jit warm-up (bench) rc $?"; reap
    for t in --cuda-graphs ""; do
      timeout 140 $G python3 -m attnplug.bench --providers triton,flashinfer,fa3 --rows "$R" $t --out "$W/bench-graphs" \
        --time-budget 110 --no-ceilings > "$W/bench-graphs$t.log" 2>&1; log "bench graphs '$t' rc $?"
    done ;;
  fp8-host)
    timeout 150 $G python3 -m pytest tests/gpu/test_fp8_gpu.py -q -rfEs -k host_scales > "$W/pytest-fp8-host.log" 2>&1
    log "pytest fp8 host scales rc $?"; tail -n 3 "$W/pytest-fp8-host.log" ;;
  ncu)
    NCU="ncu --profile-from-start off --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis
      --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
    # NCU_CASES: ';'-separated "ROW|ncu_probe args" (default: the decode rows and the shared-prefix row)
    CASES=${NCU_CASES:-"decode 64x4096 fp8;decode 64x4096;decode 1x32768 fp8;decode 1x32768;decode 4x32768;cascade decode 64x(8192+256)|--cascade auto;decode 64x(8192+256) unshared"}
    n=0
    while IFS= read -r r; do
      [[ -z $r ]] && continue
      n=$((n + 1)); row=${r%%|*}; extra=(); [[ $r == *"|"* ]] && eval "extra=(${r#*|})"
      timeout 75 $G $NCU python3 benchmarks/probes/ncu_probe.py --check --row "$row" "${extra[@]}" > "$W/ncu-$n.log" 2>&1
      log "ncu $n ($r) rc $?"; grep "^ncu_probe" "$W/ncu-$n.log"
      grep -E "^  [a-z_]+ \(|Duration  " "$W/ncu-$n.log" | paste - - | awk '{print "   ", $1, $(NF)}'
    done < <(tr ';' '\n' <<< "$CASES") ;;
  sweep-fp8)
    timeout 220 $G python3 benchmarks/sweep_triton.py --write --pairs-only --budget 170 --rows "${SWEEP_FP8_ROWS:-64x4096 fp8,1x32768 fp8,4x32768 fp8}" \
      --out "$W/sweep-fp8" > "$W/sweep-fp8.log" 2>&1; log "sweep-fp8 rc $?"; grep "^sweep:" "$W/sweep-fp8.log" | tail -n 8
    cp attnplug/core/kernels/tiles.py "$W/sweep-fp8/tiles.py" 2>/dev/null ;;
  fp8-triton)
    timeout 150 $G python3 -m pytest tests/gpu/test_fp8_gpu.py -q -rfEs -k "triton" > "$W/pytest-fp8-triton.log" 2>&1
    log "pytest fp8 triton rc $?"; tail -n 3 "$W/pytest-fp8-triton.log" ;;
  bench-fp8)
    R='decode 1x32768$,decode 1x32768 fp8$,decode 4x32768$,decode 64x4096$,decode 64x4096 fp8$'
    timeout 150 $G python3 -m attnplug.bench --providers triton,fa3 --rows "$R" --cuda-graphs --out "$W/bench-fp8" \
      --time-budget 120 --no-ceilings > "$W/bench-fp8.log" 2>&1; log "bench fp8 (graphs) rc $?"
    grep -E "attnplug.triton |fa3.paged " "$W/bench-fp8.log" | head -12 ;;
  bench-layout)
    R='decode 64x4096$,decode 64x4096 fp8$,decode 128x2048$,decode 128x2048 fp8$,decode 64x4096 HND$,decode 64x4096 fp8 HND$'
    timeout 200 $G python3 -m attnplug.bench --providers triton,fa3 --rows "$R" --cuda-graphs --out "$W/bench-layout" \
      --time-budget 170 --no-ceilings > "$W/bench-layout.log" 2>&1; log "bench layout (graphs) rc $?"
    grep -E "attnplug.triton |fa3.paged " "$W/bench-layout.log" | head -12 ;;
  fast-fp8)
    timeout 120 $G python3 -m pytest tests/core/test_fast_kernels.py -q -rfEs -k "fp8 or pairs or full_batch" > "$W/pytest-fast-fp8.log" 2>&1
    log "pytest fast fp8 rc $?"; tail -n 3 "$W/pytest-fast-fp8.log" ;;
  graphs-only)
    reap
    R='decode 1x32768$,decode 1x32768 fp8$,decode 4x32768$,decode 64x4096$,decode 64x4096 fp8$'
    timeout 170 $G python3 -m attnplug.bench.jit_warmup --bench > "$W/warm-bench.log" 2>&1; log "jit warm-up (bench) rc $?"; reap
    timeout 150 $G python3 -m attnplug.bench --providers triton,flashinfer,fa3 --rows "$R" --cuda-graphs --out "$W/bench-graphs" \
      --time-budget 120 --no-ceilings > "$W/bench-graphs.log" 2>&1; log "bench graphs rc $?" ;;
  sweep-prefix)
    timeout 330 $G python3 benchmarks/sweep_cascade_prefix.py --write --out "$W/sweep-prefix" > "$W/sweep-prefix.log" 2>&1
    log "sweep-prefix rc $?"; grep "table entry" "$W/sweep-prefix.log"; cp attnplug/core/kernels/tiles.py "$W/sweep-prefix/" ;;
  cascade-tf)
    timeout 150 $G python3 -m pytest -x tests/gpu/test_cascade_gpu.py tests/core/test_cascade_graph.py tests/core/test_kernel_paths.py \
      -q -rfEs -k "(cascade or merge or prefix or replay or update) and not flashinfer" > "$W/pytest-cascade-tf.log" 2>&1
    log "pytest cascade rc $?"; tail -n 3 "$W/pytest-cascade-tf.log" ;&
  shared-tf)
    timeout 150 $G python3 -m attnplug.bench --providers triton,fa3 --rows '64x(8192+256)' --out "$W/bench-shared-tf" \
      --time-budget 120 --no-ceilings > "$W/bench-shared-tf.log" 2>&1; log "bench shared (triton, fa3) rc $?"
    grep -E "attnplug\.(triton|fa3)" "$W/bench-shared-tf.log" | cut -c1-140 | head -24 ;;
  sweep-suffix)
    timeout 120 $G python3 -m pytest tests/core/test_cascade_graph.py -q -rfEs > "$W/pytest-cascade-graph.log" 2>&1
    log "pytest cascade graph rc $?"; tail -n 2 "$W/pytest-cascade-graph.log"
    timeout 260 $G python3 benchmarks/probes/sweep_cascade_suffix.py --out "$W/sweep-cascade-suffix.jsonl" \
      > "$W/sweep-cascade-suffix.log" 2>&1; log "sweep cascade suffix rc $?"; grep "^sweep-suffix" "$W/sweep-cascade-suffix.log" | cut -c1-330 ;;
  probe-unshared)
    timeout 150 $G python3 benchmarks/probes/cascade_unshared_probe.py --out "$W/cascade-unshared-probe.json" \
      > "$W/cascade-unshared-probe.log" 2>&1; log "cascade unshared probe rc $?"; cat "$W/cascade-unshared-probe.log" | tail -n 6 ;;
  sweep-prefill)
    timeout 240 $G python3 benchmarks/sweep_triton.py --write --budget 180 --rows 'prefill 4x4096$,prefill 1x8192$,extend 8x(512+4096)$,page64' \
      --out "$W/sweep-prefill" > "$W/sweep-prefill.log" 2>&1; log "sweep-prefill rc $?"; grep "^sweep:" "$W/sweep-prefill.log" | tail -n 8
    cp attnplug/core/kernels/tiles.py "$W/sweep-prefill/"
    timeout 150 $G python3 -m attnplug.bench --providers triton,fa3 --rows prefill --out "$W/bench-prefill-tf" \
      --time-budget 120 > "$W/bench-prefill-tf.log" 2>&1; log "bench prefill (triton, fa3) rc $?"
    grep -E "prefill|extend" "$W/bench-prefill-tf.log" | cut -c1-160 | head -20 ;;
  sweep-prefix64)
    timeout 200 $G python3 benchmarks/sweep_cascade_prefix.py --write --block-m 64 --out "$W/sweep-prefix64" > "$W/sweep-prefix64.log" 2>&1
    log "sweep-prefix64 rc $?"; grep "table entry\|best\|chosen" "$W/sweep-prefix64.log" | head; cp attnplug/core/kernels/tiles.py "$W/sweep-prefix64/" ;;
  cg-short)
    timeout 200 $G python3 benchmarks/probes/cascade_graph_bench.py --graphs-only --only "nothing shared" --out "$W/cg-short" \
      > "$W/cg-short.log" 2>&1; log "cascade graph bench (nothing shared) rc $?"
    grep -E '"(graph_auto_over_off)"|nothing shared"' "$W/cg-short.log" | head -24 ;;
  plan-cost)
    timeout 200 $G python3 benchmarks/probes/plan_cost.py --device cuda --providers triton,fa3 --calls 1000 --warmup 100 \
      --out "$W/plan-cost-h200.json" > "$W/plan-cost.log" 2>&1; log "plan cost rc $?"; cut -c1-400 "$W/plan-cost.log" ;;
  paths-plan)
    timeout 240 $G python3 -m pytest tests/core/test_staging.py tests/gpu/test_plan_no_sync.py tests/core/test_kernel_paths.py \
      tests/gpu/test_providers_gpu.py -q -rfEs -k "not flashinfer" > "$W/pytest-paths-plan.log" 2>&1
    log "pytest paths plan rc $?"; tail -n 3 "$W/pytest-paths-plan.log"
    timeout 200 $G python3 benchmarks/probes/plan_cost.py --device cuda --providers triton,fa3 --calls 1000 --warmup 100 \
      --out "$W/plan-cost-h200.json" > "$W/plan-cost.log" 2>&1; log "plan cost rc $?"; cut -c1-400 "$W/plan-cost.log" ;;
  sweep-deep)
    timeout 240 $G python3 benchmarks/sweep_triton.py --write --deep --budget 190 \
      --rows "decode 1x32768\$,decode 4x32768\$,decode 64x4096\$,decode 128x2048\$,decode 1x32768 fp8,decode 4x32768 fp8,decode 64x4096 fp8" \
      --out "$W/sweep-deep" > "$W/sweep-deep.log" 2>&1; log "sweep-deep rc $?"; grep "^sweep:" "$W/sweep-deep.log" | tail -n 10
    cp attnplug/core/kernels/tiles.py "$W/sweep-deep/tiles.py" 2>/dev/null ;;
  mask-plan)
    timeout 150 $G python3 -m pytest tests/gpu/test_plan_no_sync.py tests/gpu/test_providers_gpu.py -q -rfEs \
      -k "not flashinfer and (verify or mask or sync)" > "$W/pytest-mask-plan.log" 2>&1
    log "pytest mask plan rc $?"; tail -n 3 "$W/pytest-mask-plan.log" ;;
  wave-tests)
    ATTNPLUG_GLUON=1 timeout 260 $G python3 -m pytest tests/gpu/test_sinks_gpu.py tests/gpu/test_workspace_gpu.py \
      tests/gpu/test_mla_gpu.py tests/gpu/test_chain_verify_gpu.py tests/gpu/test_cascade_gpu.py \
      tests/gpu/test_gluon_prefill_gpu.py tests/core/test_cascade_graph.py tests/core/test_cascade_launches.py \
      -q -rfEs -k "not flashinfer" > "$W/pytest-wave.log" 2>&1; log "pytest wave rc $?"; tail -n 5 "$W/pytest-wave.log" ;;
  gluon | gluon-quick)
    limit=200 extra=(); [[ $step == gluon-quick ]] && limit=150 extra=(--no-sweep)  # without the configuration sweep
    ATTNPLUG_GLUON=1 timeout $limit $G python3 benchmarks/probes/gluon_prefill_probe.py --out "$W/gluon-prefill-probe.json" \
      "${extra[@]}" > "$W/gluon.log" 2>&1; log "$step probe rc $?"; tail -n 12 "$W/gluon.log" ;;
  cascade43)
    timeout 200 $G python3 benchmarks/probes/cascade_unshared_bench.py --providers triton,fa3 \
      --out "$W/cascade-unshared-bench.json" > "$W/cascade43.log" 2>&1; log "cascade unshared bench rc $?"
    tail -n 20 "$W/cascade43.log" ;;
  suite)
    timeout "${SUITE_S:-300}" $G python3 -m pytest tests/gpu tests/core -k "not flashinfer" -m "not network" -n 8 -q -rfEs \
      --junitxml "$W/suite.junit.xml" > "$W/pytest-suite.log" 2>&1; log "pytest suite (not flashinfer) rc $?"
    grep -E "^(FAILED|ERROR)" "$W/pytest-suite.log" | head -n 20; tail -n 3 "$W/pytest-suite.log" ;;
  sinks-memcheck)
    timeout 240 $G "${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}" --tool memcheck --print-limit 20 python3 -m pytest tests/core/test_sinks.py \
      -q -rfEs -p no:xdist -k "not flashinfer" > "$W/sinks-memcheck.log" 2>&1; log "sinks memcheck rc $?"
    grep -E "ERROR SUMMARY|Invalid|passed|failed" "$W/sinks-memcheck.log" | tail -n 8 ;;
  mla-h128)
    timeout 200 $G python3 benchmarks/probes/mla_sweep.py --rows h128 --out "$W/mla-sweep-h128.json" \
      > "$W/mla-h128.log" 2>&1; log "mla sweep h128 rc $?"; tail -n 15 "$W/mla-h128.log" ;;
  mla)
    timeout 200 $G python3 -m attnplug.bench --rows MLA --out "$W/bench-mla" > "$W/mla.log" 2>&1; log "bench MLA rc $?"
    tail -n 15 "$W/mla.log" ;;
  *) log "unknown step $step" ;;
  esac
done
tar czf "$OUT/session.tgz" -C "$OUT" w && rm -rf "$W"
