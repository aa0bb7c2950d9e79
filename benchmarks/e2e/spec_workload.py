"""Speculative-decoding helpers of the e2e harness (``engine_run.py``): a workload where drafts are
accepted, and accepted tokens per step from the engines' counters.

Cycle prompts (``--prompts cycle``): a random-weight model's greedy continuation falls into a cycle
(a token or a short phrase repeated). At warm-up each prompt's *seed* (:data:`SEED_LEN` random tokens)
is continued greedily for :data:`GEN_LEN` tokens (not timed); the timed prompt is fresh random tokens
followed by seed + continuation, ``plen`` tokens in all. Its end already repeats the cycle, so n-gram
lookup proposes the next tokens, and the target (which continues its own cycle) accepts them. The
fresh random head keeps the prompt out of the prefix cache. :func:`find_cycle` says which prompts
ended in a cycle (recorded per row).
"""

from __future__ import annotations

import random

SEED_LEN, GEN_LEN = 64, 192


def find_cycle(tokens: list[int], min_repeats: int = 2) -> tuple[int, int] | None:
    """``(period, tail)`` of the shortest period ``p`` whose last ``tail >= min_repeats * p`` tokens
    repeat with period ``p`` (``tokens[i] == tokens[i - p]`` over the tail), ``tail`` as long as it
    goes; ``None`` when no period repeats ``min_repeats`` times at the end."""
    n = len(tokens)
    for p in range(1, n // min_repeats + 1):
        tail = p
        while tail < n and tokens[n - 1 - tail] == tokens[n - 1 - tail + p]:
            tail += 1
        if tail >= min_repeats * p:
            return p, tail
    return None


def cycle_prompts(generate, bs: int, plen: int, seed: int, vocab_hi: int) -> tuple[list[list[int]], dict]:
    """``bs`` prompts of ``plen`` tokens ending in the model's own greedy continuation, and stats
    ``{"cycles": prompts whose continuation ends in a cycle, "mean_period": ...}``.

    ``generate(prompts, n)`` returns the engine's greedy outputs (``[{"tokens": [...]}, ...]``)."""
    if plen < SEED_LEN + GEN_LEN:
        raise ValueError(f"cycle prompts need plen >= {SEED_LEN + GEN_LEN}, got {plen}")
    rng = random.Random(seed)
    seeds = [[rng.randrange(3, vocab_hi) for _ in range(SEED_LEN)] for _ in range(bs)]
    outs = generate(seeds, GEN_LEN)
    prompts, periods = [], []
    for s, o in zip(seeds, outs):
        tail = s + list(o["tokens"])[:GEN_LEN]
        head = [rng.randrange(3, vocab_hi) for _ in range(plen - len(tail))]
        prompts.append(head + tail)
        c = find_cycle(list(o["tokens"]))
        if c:
            periods.append(c[0])
    stats = {
        "cycles": len(periods),
        "prompts": bs,
        "mean_period": round(sum(periods) / len(periods), 2) if periods else None,
    }
    return prompts, stats


def vllm_step_stats(ntok: int, c0: dict, c1: dict) -> dict:
    """Speculation counts of one vLLM run of ``ntok`` output tokens from its counters before (``c0``) and
    after (``c1``): ``vllm:spec_decode_num_drafts`` (verify steps: requests x steps with a draft) and
    ``..._num_accepted_tokens``. Every target step of a request emits 1 + its accepted tokens, so the
    run took ``ntok - accepted`` request steps (the prefill's and draft-less ones included):
    ``accepted_per_step = ntok / (ntok - accepted)`` (1.0 when nothing was drafted or accepted, e.g.
    n-gram on prompts with no repeats). ``accepted_per_verify``: over verify steps only."""
    if c1.get("steps") is None or c1.get("accepted") is None:
        return {"accepted_per_step": None, "why": "vLLM exposes no spec_decode counters (get_metrics)"}
    accepted, drafts = c1["accepted"] - c0.get("accepted", 0), c1["steps"] - c0.get("steps", 0)
    r = {"tokens": ntok, "target_steps": ntok - accepted, "verify_steps": drafts, "accepted": accepted}
    return finish(r)


def sglang_step_stats(outs: list[dict]) -> dict:
    """Speculation counts of one SGLang run from each request's ``spec_verify_ct`` (SGLang sets it only
    for a request with verify steps; one without emitted each token in a step of its own)."""
    steps = sum(o.get("spec_verify_ct") or len(o["tokens"]) for o in outs)
    verify = sum(o.get("spec_verify_ct") or 0 for o in outs)
    ntok = sum(len(o["tokens"]) for o in outs)
    return finish({"tokens": ntok, "target_steps": steps, "verify_steps": verify})


def finish(r: dict) -> dict:
    """``r`` with ``accepted_per_step = tokens / target_steps`` (and, for vLLM, ``accepted_per_verify``)."""
    r["accepted_per_step"] = round(r["tokens"] / r["target_steps"], 3) if r["target_steps"] else None
    if r.get("accepted") is not None and r["verify_steps"]:
        r["accepted_per_verify"] = round((r["accepted"] + r["verify_steps"]) / r["verify_steps"], 3)
    return r


def merge(a: dict | None, b: dict) -> dict:
    """Sum the counts of two runs of a row and recompute the ratios."""
    if a is None or a.get("accepted_per_step") is None and "tokens" not in a:
        return b
    if "tokens" not in b:
        return a
    keys = ("tokens", "target_steps", "verify_steps", "accepted")
    return finish({k: a[k] + b[k] for k in keys if k in a and k in b})
