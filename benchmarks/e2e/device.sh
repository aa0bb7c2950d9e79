#!/usr/bin/env bash
# Engine end-to-end runs on the offline H200 machine, fed over consecutive device calls
# (each carries <= 64 MiB; the machine is kept only while calls follow each other within ~30 s).
# Bundles: ../shared/tools/gpu-vllm-bundle.sh .bundle/vllm ; ../shared/tools/gpu-sglang-bundle.sh .bundle/sglang
#
#   vLLM 0.26 (one machine; calls back to back):
#     carry .bundle/vllm/a    bash benchmarks/e2e/device.sh vllm-a     # lanes, random model, vLLM jobs queued
#     carry .bundle/vllm/b    bash benchmarks/e2e/device.sh vllm-b     # jobs start (+ issue-5 GPU suite)
#                             bash benchmarks/e2e/device.sh wait [MAX_S]   # until done
#     or, when both parts were unpacked into /tmp/vsite by earlier calls on the same warm machine:
#     E2E_BACKENDS="FLASH_ATTN ATTNPLUG_FLASHINFER" E2E_ROWS=0,1 bash benchmarks/e2e/device.sh vllm-warm [MAX_S]
#   SGLang 0.5.17 (same or another machine):
#     carry .bundle/sglang/a  bash benchmarks/e2e/device.sh sglang-a   # lanes, model, SGLang jobs queued
#     carry .bundle/sglang/b  bash benchmarks/e2e/device.sh sglang-b   # SGLang jobs start
#     carry .bundle/fa3       bash benchmarks/e2e/device.sh fa3        # FA3 for attnplug_fa3 (cp vllm/b/fa3.so.xz + flash_attn_interface.py;
#                                                                      # or carry .gpu: its fa3.zip, gpu-wheels.sh)
#     E2E_BASE=0 sglang-a: unpack only (the fp8 / shared stages queue their own jobs)
#                             bash benchmarks/e2e/device.sh wait [MAX_S]
#   Issue 18 (tensor parallel, speculation), on a machine where the engine's parts are unpacked (the
#   calls above): TP=2 jobs hold both GPUs (queued on lane 0 only, CUDA_VISIBLE_DEVICES=0,1; NVLink
#   multicast stays off: engine_run.py's TP_ENV), speculation jobs use repetitive prompts:
#     bash benchmarks/e2e/device.sh vllm-tp | sglang-tp       # rows E2E_ROWS (default 0,1), native + attnplug
#     bash benchmarks/e2e/device.sh vllm-spec | sglang-spec   # n-gram on/off, EAGLE graphs vs eager
#   Issues 15 and 13, same machine: fp8 KV cache (rows E2E_ROWS, default 0,1, with the default-dtype run
#   of each backend for the KV capacity ratio) and the shared-prefix row (64 x (8192 + 256) -> 256):
#     bash benchmarks/e2e/device.sh vllm-fp8 | sglang-fp8 | vllm-shared | sglang-shared
#   Cascade graphs on unshared rows (issue 13): E2E_BACKENDS="ATTNPLUG_TRITON" bash benchmarks/e2e/device.sh vllm-cg
#   Cascade graphs (issue 43, opt-in): shared row, n = 8 sampling row, rows 0-3, defaults vs
#   ATTNPLUG_CASCADE_GRAPHS=1 interleaved: bash benchmarks/e2e/device.sh vllm-cascade43 | sglang-cascade43
#   EAGLE with graphs alone (SGLang): E2E_BACKENDS="attnplug_triton" bash benchmarks/e2e/device.sh sglang-eagle
#   Issue 45 (MLA: a dense DeepSeek-V2 with random weights, E2E_MLA_LAYERS layers, default 8), after the
#   engine's parts are unpacked: rows 0,1,3 of each engine's MLA backends and attnplug's (E2E_BACKENDS picks):
#     bash benchmarks/e2e/device.sh vllm-mla | sglang-mla
#   (E2E_MODEL=0 on every call of such a chain: the Llama model is not made)
#   Issue 41 (gpt-oss: sinks, alternating 128-token windows, d64; make_model.py --gpt-oss, E2E_OSS_LAYERS layers,
#   default 4), after the engine's parts are unpacked: rows 0,1,3 of the natives with sinks and attnplug's three:
#     bash benchmarks/e2e/device.sh vllm-gptoss | sglang-gptoss
#   Issue 42 (speculation in full graphs, drafts accepted: --prompts cycle), after the engine's parts are unpacked:
#     bash benchmarks/e2e/device.sh vllm-spec42 | sglang-spec42    # E2E_BACKENDS picks backends
#   (E2E_BACKENDS="..." picks the backends; E2E_DEFAULT_DTYPE="..." limits the fp8 stages' default-dtype
#   runs to those backends (the KV capacity ratio needs one); on one GPU the jobs run one after another, ~2-3 min each;
#   the shared stages run attnplug_triton / attnplug_fa3 twice, the second with ATTNPLUG_CASCADE_GRAPHS=1)
# Every call ends with `lanes.py wait` (returns early when all lanes are idle) and leaves
# $OUT/lanes-logs.tar.gz: job logs, statuses, result JSONs, issue-5 pytest/bench output so far.
set -uo pipefail
cd "$(dirname "$0")/../.."
stage=${1:-wait}; max=${2:-}
R=/tmp/e2e; L="python3 $R/bin/lanes.py"; LANES=$R/lanes; RES=$R/res
MODEL=/tmp/llama8b-rand; DRAFT=/tmp/eagle-draft; MLA_MODEL=/tmp/dsv2-rand; OSS_MODEL=/tmp/gptoss-rand
V=/tmp/vsite; S=/tmp/ssite; FA3=/tmp/fa3site; AP=/tmp/apsite-$stage
export PYTHONUNBUFFERED=1

queue() {  # queue GPU NAME TIMEOUT NEEDS... -- CMD
  local gpu=$1 name=$2 to=$3; shift 3; local needs=()
  while [[ $1 != -- ]]; do needs+=(--needs "$1"); shift; done; shift
  $L add $LANES --gpu "$gpu" --name "$name" --timeout "$to" "${needs[@]}" -- "$@"
}
tags() {  # the result name's suffix for engine_run args
  local t=""
  [[ " $* " == *" --eager "* ]] && t+=-eager; [[ " $* " == *" --env "* ]] && t+=-env
  [[ " $* " == *" --tp 2 "* ]] && t+=-tp2; [[ " $* " == *" --spec ngram "* ]] && t+=-ngram
  [[ " $* " == *" --eagle-draft "* ]] && t+=-eagle; [[ " $* " == *" --prompts repeat "* ]] && t+=-repeat
  [[ " $* " =~ " --kv-cache-dtype "([a-z0-9_]+)" " ]] && t+=-kv${BASH_REMATCH[1]}
  [[ " $* " == *" --prompts shared "* ]] && t+=-shared; [[ " $* " == *" --prompts cycle "* ]] && t+=-cycle
  [[ " $* " =~ " --samples "([0-9]+)" " ]] && t+=-n${BASH_REMATCH[1]}
  echo "$t"
}
vllm_job() {  # GPU BACKEND [extra engine_run args]; GPU "0,1": both GPUs, queued on lane 0; JOB_TAG prefixes the name
  local gpu=$1 b=$2; shift 2; local tag=${JOB_TAG:-}$b$(tags "$@") vis="" m=${JOB_MODEL:-$MODEL}
  [[ $gpu == *,* ]] && { vis="CUDA_VISIBLE_DEVICES=$gpu"; gpu=0; }
  queue "$gpu" "vllm-$tag" 480 $V/.ready-b $m/attnplug_random.json -- \
    "$vis VLLM_CACHE_ROOT=/tmp/vcache$gpu FLASHINFER_WORKSPACE_BASE=/tmp/fi-vllm PYTHONPATH=/tmp/apsite-vllm-a:$V python3 $R/bin/engine_run.py vllm $b --model $m --out $RES/vllm-$tag.json $*"
}
sglang_job() {  # GPU BACKEND NAME [extra engine_run args]; GPU "0,1" as above. deep_gemm: a stand-in
  # (benchmarks/e2e/stubs) for the import SGLang's EAGLE graph capture makes (never called for Llama;
  # SGLANG_ENABLE_JIT_DEEPGEMM=0 so SGLang does not take the stand-in for DeepGEMM)
  local gpu=$1 b=$2 name=$3; shift 3; local fa=() vis="" m=${JOB_MODEL:-$MODEL}; [[ $b == *fa3* ]] && fa=($FA3/.ready)
  [[ $gpu == *,* ]] && { vis="CUDA_VISIBLE_DEVICES=$gpu"; gpu=0; }
  queue "$gpu" "sglang-$name" 420 $S/.ready-b $m/attnplug_random.json "${fa[@]}" -- \
    "$vis SGLANG_ENABLE_JIT_DEEPGEMM=0 FLASHINFER_WORKSPACE_BASE=/tmp/fi-sglang PYTHONPATH=/tmp/apsite-sglang-a:$S:$FA3:$R/stubs python3 $R/bin/engine_run.py sglang $b --model $m --out $RES/sglang-$name.json $*"
}
mla_model() {  # issue 45: the dense DeepSeek-V2 (MLA) of make_model.py --deepseek-v2, queued once (E2E_MLA_LAYERS, default 8)
  [[ -e $MLA_MODEL/.queued ]] || { mkdir -p $MLA_MODEL && touch $MLA_MODEL/.queued &&
    queue 0 make-mla-model 600 -- "python3 $R/bin/make_model.py $MLA_MODEL --deepseek-v2 --layers ${E2E_MLA_LAYERS:-8}"; }
}

oss_model() {  # issue 41: the gpt-oss-20b-shaped model of make_model.py --gpt-oss, queued once (E2E_OSS_LAYERS, default 4)
  [[ -e $OSS_MODEL/.queued ]] || { mkdir -p $OSS_MODEL && touch $OSS_MODEL/.queued &&
    queue 0 make-oss-model 600 -- "python3 $R/bin/make_model.py $OSS_MODEL --gpt-oss --layers ${E2E_OSS_LAYERS:-4}"; }
}

setup() {  # idempotent: scripts snapshot, attnplug installed from this call's tree (entry points), lanes, model
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  mkdir -p $R/bin $RES && cp benchmarks/e2e/*.py $R/bin/ && rm -rf $R/stubs && cp -r benchmarks/e2e/stubs $R/stubs
  rm -rf $AP && python3 -m pip install -q --no-deps --no-index --no-build-isolation --target $AP . 2>&1 | tail -3
  grep -A1 plugins $AP/attnplug-*.dist-info/entry_points.txt
  [[ -d $R/repo ]] || { mkdir -p $R/repo && tar cf - --exclude=.bundle --exclude=.venvs --exclude=.git . | tar xf - -C $R/repo; }
  ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())'); g1=$(( ngpu > 1 ? 1 : 0 ))
  $L start $LANES --gpus "$(seq -s, 0 $((ngpu - 1)))"
  # E2E_MODEL=0: no Llama model (a call chain that runs only the MLA / gpt-oss stages, which make their own)
  [[ ${E2E_MODEL:-1} == 0 || -e $MODEL/.queued ]] || { mkdir -p $MODEL && touch $MODEL/.queued &&
    queue 0 make-model 300 -- "python3 $R/bin/make_model.py $MODEL --eagle-draft $DRAFT"; }
}

case $stage in
vllm-a)
  setup
  mkdir -p $V && xz -dc .bundle/vllm/a/vllm-py-C.tar.xz | tar xf - -C $V && touch $V/.ready-a
  # ROWS (default all): engine_run --rows; the kernel suite runs in its own call (scripts/gpu_run.sh)
  rows=${E2E_ROWS:+--rows $E2E_ROWS}
  if [[ ${E2E_BASE:-1} == 1 ]]; then  # E2E_BASE=0: only unpack (a later stage queues its own jobs)
    vllm_job 0 FLASH_ATTN $rows;      vllm_job $g1 ATTNPLUG_FLASHINFER $rows
    vllm_job 0 ATTNPLUG_TRITON $rows; vllm_job $g1 FLASHINFER $rows
    [[ -n ${E2E_FULL:-} ]] && { vllm_job 0 TRITON_ATTN; vllm_job $g1 ATTNPLUG_FA3; }
  fi
  $L wait $LANES --max "${max:-15}" --out "$OUT" --results $RES ;;
vllm-warm)  # both vLLM parts already unpacked into $V by earlier calls on this machine (no carry)
  [[ -f $V/vllm/__init__.py && -f $V/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so ]] || { echo "vllm-warm: $V incomplete"; exit 1; }
  setup; touch $V/.ready-a $V/.ready-b
  rows=${E2E_ROWS:+--rows $E2E_ROWS}
  for b in ${E2E_BACKENDS:-FLASH_ATTN ATTNPLUG_FLASHINFER}; do vllm_job 0 "$b" $rows; done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
vllm-b)
  xz -dc .bundle/vllm/b/deps.tar.xz | tar xf - -C $V &&
    xz -dc .bundle/vllm/b/fa3.so.xz > $V/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so &&
    xz -dc .bundle/vllm/b/third_party.tar.xz | tar xf - -C $V || exit 1
  touch $V/.ready-b; echo "vllm-b installed"
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
sglang-a)
  setup
  mkdir -p $S && xz -dc .bundle/sglang/a/sg.tar.xz | tar xf - -C $S && touch $S/.ready-a && echo "sglang-a unpacked"
  if [[ ${E2E_BASE:-1} == 1 ]]; then  # E2E_BASE=0: only unpack (a later stage queues its own jobs)
    sglang_job $g1 flashinfer flashinfer;                   sglang_job 0 triton triton
    sglang_job $g1 attnplug_flashinfer attnplug_flashinfer; sglang_job 0 attnplug_triton attnplug_triton
    # EAGLE (topk 4, 3 steps, 8 draft tokens) with CUDA graphs: target verify + draft decode captured by
    # attnplug, draft extend eager (SGLang captures it only for its own backend classes)
    sglang_job $g1 attnplug_triton eagle-attnplug_triton --eagle-draft $DRAFT --rows 0
    sglang_job 0 attnplug_fa3 attnplug_fa3
    sglang_job $g1 attnplug_flashinfer eagle-attnplug_flashinfer --eagle-draft $DRAFT --rows 0
    sglang_job 0 attnplug_fa3 eagle-attnplug_fa3 --eagle-draft $DRAFT --rows 0  # fa3 tree verify in graphs
    sglang_job $g1 attnplug_triton attnplug_triton-eager --eager --rows 0,1
  fi
  $L wait $LANES --max "${max:-15}" --out "$OUT" --results $RES ;;
sglang-b)
  xz -dc .bundle/sglang/b/deps.tar.xz | tar xf - -C $S && touch $S/.ready-b && echo "sglang-b installed"
  $L wait $LANES --max "${max:-480}" --out "$OUT" --results $RES ;;
fa3)  # vLLM's FA3 build as a standalone `vllm_flash_attn` package (sgl_kernel's FA3 is not in the bundle),
  # from .bundle/fa3 (fa3.so.xz + flash_attn_interface.py) or, when carried, .gpu/fa3.zip (gpu-wheels.sh)
  mkdir -p $FA3/vllm_flash_attn && touch $FA3/vllm_flash_attn/__init__.py
  if [[ -f .bundle/fa3/fa3.so.xz ]]; then
    cp .bundle/fa3/flash_attn_interface.py $FA3/vllm_flash_attn/ &&
      xz -dc .bundle/fa3/fa3.so.xz > $FA3/vllm_flash_attn/_vllm_fa3_C.abi3.so || exit 1
  else
    python3 -m zipfile -e .gpu/fa3.zip $FA3/zip && cp $FA3/zip/vllm/vllm_flash_attn/* $FA3/vllm_flash_attn/ || exit 1
  fi
  touch $FA3/.ready && echo "fa3 installed"
  $L wait $LANES --max "${max:-480}" --out "$OUT" --results $RES ;;
vllm-tp)  # vLLM parts already unpacked into $V (vllm-a / vllm-b earlier on this machine)
  setup; rows="--rows ${E2E_ROWS:-0,1}"
  for b in FLASH_ATTN ATTNPLUG_FA3 ATTNPLUG_TRITON FLASHINFER ATTNPLUG_FLASHINFER; do vllm_job 0,1 "$b" --tp 2 $rows; done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
vllm-spec)
  setup
  for b in FLASH_ATTN ATTNPLUG_FA3 ATTNPLUG_TRITON; do
    vllm_job 0 "$b" --prompts repeat --rows 0,1; vllm_job 1 "$b" --spec ngram --prompts repeat --rows 0,1
  done
  vllm_job 0 ATTNPLUG_TRITON --eagle-draft $DRAFT --rows 0; vllm_job 1 ATTNPLUG_TRITON --eagle-draft $DRAFT --eager --rows 0
  vllm_job 0 ATTNPLUG_FA3 --eagle-draft $DRAFT --rows 0;    vllm_job 1 FLASH_ATTN --eagle-draft $DRAFT --rows 0
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
sglang-tp)  # SGLang parts already unpacked into $S (and FA3 for attnplug_fa3)
  setup; rows="--rows ${E2E_ROWS:-0,1}"
  for b in flashinfer attnplug_fa3 attnplug_triton attnplug_flashinfer; do sglang_job 0,1 "$b" "$b-tp2" --tp 2 $rows; done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
sglang-spec)
  setup
  for b in flashinfer attnplug_fa3 attnplug_triton; do
    sglang_job 0 "$b" "$b-repeat" --prompts repeat --rows 0,1
    sglang_job 1 "$b" "$b-ngram-repeat" --spec ngram --prompts repeat --rows 0,1
  done
  sglang_job 0 attnplug_triton eagle-graphs-attnplug_triton --eagle-draft $DRAFT --rows 0
  sglang_job 1 attnplug_triton eagle-eager-attnplug_triton --eagle-draft $DRAFT --eager --rows 0
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
vllm-fp8)
  setup; rows="--rows ${E2E_ROWS:-0,1}"
  # a backend written NAME@VAR=VALUE runs its fp8 job with that variable set (e.g. ATTNPLUG_TRITON@VLLM_KV_CACHE_LAYOUT=NHD)
  for spec in ${E2E_BACKENDS:-FLASH_ATTN ATTNPLUG_FA3 ATTNPLUG_TRITON FLASHINFER ATTNPLUG_FLASHINFER}; do
    b=${spec%%@*}
    if [[ $spec == *@* ]]; then vllm_job 0 "$b" --kv-cache-dtype fp8 $rows --env "${spec#*@}"; continue; fi
    vllm_job 0 "$b" --kv-cache-dtype fp8 $rows
    [[ -z ${E2E_DEFAULT_DTYPE+x} || " $E2E_DEFAULT_DTYPE " == *" $b "* ]] && vllm_job $g1 "$b" $rows
  done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
vllm-shared)
  setup
  # a backend written NAME:cg runs only with ATTNPLUG_CASCADE_GRAPHS=1 (triton, fa3: decode graphs read the
  # shared prefix once only when asked); plain triton / fa3 run both ways
  for b in ${E2E_BACKENDS:-FLASH_ATTN FLASHINFER ATTNPLUG_FA3 ATTNPLUG_TRITON ATTNPLUG_FLASHINFER}; do
    [[ $b != *:cg ]] && vllm_job 0 "$b" --prompts shared --rows 4
    [[ ${b%:cg} == ATTNPLUG_TRITON || ${b%:cg} == ATTNPLUG_FA3 ]] &&
      vllm_job $g1 "${b%:cg}" --prompts shared --rows 4 --env ATTNPLUG_CASCADE_GRAPHS=1
  done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
vllm-cg)  # issue 13: what cascade graphs cost where nothing is shared: rows E2E_ROWS (default 0,1) of each of
  # E2E_BACKENDS (default ATTNPLUG_TRITON) with and without ATTNPLUG_CASCADE_GRAPHS=1, one GPU lane (the
  # cascade run first: its Triton compiles cover the plain run's, which then times warm kernels)
  setup; rows="--rows ${E2E_ROWS:-0,1}"
  for b in ${E2E_BACKENDS:-ATTNPLUG_TRITON}; do
    vllm_job 0 "$b" $rows --env ATTNPLUG_CASCADE_GRAPHS=1; vllm_job 0 "$b" $rows
  done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
sglang-fp8)
  setup; rows="--rows ${E2E_ROWS:-0,1}"
  for b in ${E2E_BACKENDS:-flashinfer attnplug_fa3 attnplug_triton attnplug_flashinfer}; do
    sglang_job 0 "$b" "$b-kvfp8_e4m3" --kv-cache-dtype fp8_e4m3 $rows
    [[ -z ${E2E_DEFAULT_DTYPE+x} || " $E2E_DEFAULT_DTYPE " == *" $b "* ]] && sglang_job $g1 "$b" "$b" $rows
  done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
sglang-eagle)  # EAGLE with CUDA graphs, row 0, for E2E_BACKENDS (default attnplug_triton)
  setup
  for b in ${E2E_BACKENDS:-attnplug_triton}; do sglang_job 0 "$b" "eagle-$b" --eagle-draft $DRAFT --rows 0; done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
sglang-shared)
  setup
  for b in ${E2E_BACKENDS:-flashinfer triton attnplug_fa3 attnplug_triton attnplug_flashinfer}; do
    sglang_job 0 "$b" "$b-shared" --prompts shared --rows 4
    [[ $b == attnplug_triton || $b == attnplug_fa3 ]] &&
      sglang_job $g1 "$b" "$b-cascade-graphs-shared" --prompts shared --rows 4 --env ATTNPLUG_CASCADE_GRAPHS=1
  done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
vllm-spec42)  # issue 42: cycle prompts (n-gram drafts accepted), rows 0,1: no speculation, n-gram, EAGLE (row 0)
  setup
  for b in ${E2E_BACKENDS:-FLASH_ATTN ATTNPLUG_TRITON ATTNPLUG_FA3 ATTNPLUG_FLASHINFER}; do
    vllm_job 0 "$b" --prompts cycle --rows 0,1; vllm_job $g1 "$b" --spec ngram --prompts cycle --rows 0,1
    vllm_job 0 "$b" --eagle-draft $DRAFT --prompts cycle --rows 0
  done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
sglang-spec42)  # issue 42, SGLang: the same three kinds (EAGLE topk 4, 3 steps), every backend with graphs
  setup
  for b in ${E2E_BACKENDS:-flashinfer attnplug_triton attnplug_fa3 attnplug_flashinfer}; do
    sglang_job 0 "$b" "$b-cycle" --prompts cycle --rows 0,1
    sglang_job $g1 "$b" "$b-ngram-cycle" --spec ngram --prompts cycle --rows 0,1
    sglang_job 0 "$b" "eagle-$b-cycle" --eagle-draft $DRAFT --prompts cycle --rows 0
  done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
vllm-cascade43 | sglang-cascade43)  # issue 43: cascade graphs (opt-in since 2026-12-06). The shared row (4) and
  # the n = 8 sampling row (5: one 8192 + 256-token prompt, 8 samples) of every backend with defaults; attnplug
  # triton / fa3 / flashinfer also with ATTNPLUG_CASCADE_GRAPHS=1, interleaved on one lane (defaults, then on, per
  # backend and row, back to back); rows E2E_ROWS (default 0,1,2,3) of the attnplug backends the same way
  setup; eng=${stage%-cascade43}
  for b in ${E2E_BACKENDS:-$([[ $eng == vllm ]] && echo "FLASH_ATTN FLASHINFER ATTNPLUG_FA3 ATTNPLUG_TRITON ATTNPLUG_FLASHINFER" ||
             echo "flashinfer fa3 attnplug_fa3 attnplug_triton attnplug_flashinfer")}; do
    for w in "--prompts shared --rows 4" "--prompts shared --samples 8 --rows 5" "--rows ${E2E_ROWS:-0,1,2,3}"; do
      attnplug=0; [[ ${b,,} == attnplug_* ]] && attnplug=1
      [[ $attnplug == 0 && $w == --rows\ [0-3]* ]] && continue  # the natives' rows 0-3: other stages have them
      if [[ $eng == vllm ]]; then
        vllm_job 0 "$b" $w
        ((attnplug)) && vllm_job 0 "$b" $w --env ATTNPLUG_CASCADE_GRAPHS=1
      else
        sglang_job 0 "$b" "$b$(tags $w)" $w
        ((attnplug)) && sglang_job 0 "$b" "$b-cg1$(tags $w)" $w --env ATTNPLUG_CASCADE_GRAPHS=1
      fi
    done
  done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
vllm-mla)  # issue 45: MLA (dense DeepSeek-V2, make_model.py --deepseek-v2), rows E2E_ROWS (default 0,1,3:
  # 1x1024->128, 64x1024->128, 8x16384->256), vLLM's MLA backends (FLASHMLA where the bundle has _flashmla_C)
  # and attnplug's (E2E_BACKENDS overrides the list); vLLM parts already unpacked into $V
  setup; mla_model; rows="--rows ${E2E_ROWS:-0,1,3}"
  native="FLASH_ATTN_MLA TRITON_MLA"; ls $V/vllm/_flashmla_C*.so >/dev/null 2>&1 && native+=" FLASHMLA"
  for b in ${E2E_BACKENDS:-$native ATTNPLUG_FA3_MLA ATTNPLUG_TRITON_MLA ATTNPLUG_FLASHINFER_MLA}; do
    JOB_MODEL=$MLA_MODEL vllm_job 0 "$b" $rows
  done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
sglang-mla)  # issue 45, SGLang 0.5.17: the same model and rows, flashinfer / triton vs attnplug's (result names mla-*)
  setup; mla_model; rows="--rows ${E2E_ROWS:-0,1,3}"
  for b in ${E2E_BACKENDS:-flashinfer triton attnplug_fa3 attnplug_triton attnplug_flashinfer}; do
    JOB_MODEL=$MLA_MODEL sglang_job 0 "$b" "mla-$b" $rows
  done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
vllm-gptoss)  # issue 41: gpt-oss, rows E2E_ROWS (default 0,1,3): vLLM's backends with sinks and attnplug's three
  setup; oss_model; rows="--rows ${E2E_ROWS:-0,1,3}"
  for b in ${E2E_BACKENDS:-FLASH_ATTN TRITON_ATTN ATTNPLUG_FA3 ATTNPLUG_TRITON ATTNPLUG_FLASHINFER}; do
    JOB_MODEL=$OSS_MODEL JOB_TAG=gptoss- vllm_job 0 "$b" $rows
  done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
sglang-gptoss)  # issue 41, SGLang 0.5.17 (result names gptoss-*): triton (its fa3 backend needs sgl_kernel's FA3,
  # not in the bundle) and attnplug's three
  setup; oss_model; rows="--rows ${E2E_ROWS:-0,1,3}"
  for b in ${E2E_BACKENDS:-triton attnplug_fa3 attnplug_triton attnplug_flashinfer}; do
    JOB_MODEL=$OSS_MODEL sglang_job 0 "$b" "gptoss-$b" $rows
  done
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
wait)
  $L wait $LANES --max "${max:-540}" --out "$OUT" --results $RES ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
