"""Run one vLLM ``LLM`` engine (spawned by the tests): ``python engine_job.py JOB.json OUT.json``.

JOB: model, prompts (token ids), backend (None = vLLM's choice), block_size, max_tokens,
batches (lists of prompt indexes generated one after another), engine_kwargs.
OUT: {prompt index: {token_ids, logprobs (top-k per step), num_cached_tokens}}; with
``engine_kwargs.disable_log_stats = False`` also ``metrics.json`` next to OUT: the engine's
``vllm:spec_decode*`` counters (``LLM.get_metrics()``).
"""

import json
import os
import sys


def main() -> None:
    job = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams

    kw = dict(
        model=job["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        max_model_len=512,
        max_num_seqs=8,
        block_size=job["block_size"],
        enable_prefix_caching=True,
        **job.get("engine_kwargs", {}),
    )
    if job.get("backend"):
        kw["attention_backend"] = job["backend"]
    llm = LLM(**kw)
    base = dict(max_tokens=job["max_tokens"], temperature=0.0, logprobs=3, detokenize=False, ignore_eos=True)
    sp = SamplingParams(**base)
    res, samples = {}, {}
    for batch in job["batches"]:
        if isinstance(batch, dict):  # {"prompts": [...], "sampling": {...}}: e.g. n > 1, every sample kept
            outs = llm.generate(
                [{"prompt_token_ids": job["prompts"][i]} for i in batch["prompts"]],
                SamplingParams(**{**base, **batch["sampling"]}),
                use_tqdm=False,
            )
            for i, o in zip(batch["prompts"], outs):
                samples[str(i)] = [list(c.token_ids) for c in o.outputs]
            continue
        outs = llm.generate([{"prompt_token_ids": job["prompts"][i]} for i in batch], sp, use_tqdm=False)
        for i, o in zip(batch, outs):
            c = o.outputs[0]
            res[i] = dict(
                token_ids=list(c.token_ids),
                num_cached_tokens=o.num_cached_tokens,
                logprobs=[{str(t): lp.logprob for t, lp in d.items()} for d in c.logprobs],
            )
    with open(sys.argv[2], "w") as f:
        json.dump(res, f)
    if samples:
        with open(os.path.join(os.path.dirname(sys.argv[2]), "samples.json"), "w") as f:
            json.dump(samples, f)
    if not kw.get("disable_log_stats", True):  # the engine's counters (speculative decoding: drafted / accepted)
        metrics = {
            m.name: getattr(m, "value", getattr(m, "values", None))
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode")
        }
        with open(os.path.join(os.path.dirname(sys.argv[2]), "metrics.json"), "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    main()
