#!/usr/bin/env bash
# Session-5 call 1 on the H200: soak re-run (issue 17), cascade-graph tests + bench (issue 13, vector
# predicate), FlashInfer fp8 rows + tests (issue 15). Logs and results in $OUT (tarred at the end).
set -u
W=$OUT/w; mkdir -p $W; G="bash scripts/gpu_run.sh"
$G true > $W/install.log 2>&1
t0=$SECONDS
( timeout 210 $G python3 -m attnplug.bench.soak --device cuda --phases plan_run --time-budget 120 --out $W/soak-h200-plan_run.json > $W/soak-plan.log 2>&1; echo "soak plan rc $?" >> $W/rc ) &
( timeout 210 $G python3 -m attnplug.bench.soak --device cuda --phases graph_replay --time-budget 120 --out $W/soak-h200-graph.json > $W/soak-graph.log 2>&1; echo "soak graph rc $?" >> $W/rc ) &
( timeout 150 $G python3 -m attnplug.bench.jit_warmup > $W/warm.log 2>&1; echo "warm rc $?" >> $W/rc;
  timeout 80 $G python3 -m pytest tests/gpu/test_fp8_gpu.py -q -rfEs -k flashinfer > $W/pytest-fi-fp8.log 2>&1; echo "pytest fi fp8 rc $?" >> $W/rc ) &
timeout 200 $G python3 -m pytest tests/core/test_cascade_graph.py -q -rfEs > $W/pytest-cascade-graph.log 2>&1; echo "pytest cg rc $? at $((SECONDS-t0))" >> $W/rc
wait; echo "parallel part done at $((SECONDS-t0))" >> $W/rc
# a warm-up cut by its timeout leaves FlashInfer's compilers running (timeout ends only its child):
# stop them before anything is timed
pkill -f 'ninja|nvcc|cicc|ptxas' || true; sleep 1
timeout 100 $G python3 benchmarks/cascade_graph_bench.py --out $W > $W/cg-bench.log 2>&1; echo "cg bench rc $? at $((SECONDS-t0))" >> $W/rc
timeout 140 $G python3 -m attnplug.bench --providers triton,flashinfer,fa3 --rows "decode 64x4096,decode 1x32768,prefill 4x4096,8192+256" --out $W/bench --time-budget 110 > $W/bench.log 2>&1; echo "bench rc $? at $((SECONDS-t0))" >> $W/rc
cat $W/rc; tail -n 3 $W/pytest-*.log; grep -h "growth\|summary" $W/soak-*.log | tail -20
tar czf $OUT/call1.tgz -C $OUT w && rm -rf $W
