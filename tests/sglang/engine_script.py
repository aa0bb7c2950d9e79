"""Subprocess driver for the SGLang end-to-end tests: runs ``sglang.Engine`` (SGLang spawns, so this
needs its own ``__main__``) for one or more runs and writes the generated ids as JSON.

    python engine_script.py SPEC.json OUT.json

SPEC: ``{"model": path, "prompts": [[ids]], "max_new_tokens": n, "waves": [[prompt idx]],
"runs": [{"name": .., "engine": {kwargs}, "env": {var: value}}]}``; ``env`` is set before the
engine starts (its scheduler process inherits it). Waves are generated one after the other; a wave
``{"prompts": [idx], "sampling": {...}}`` (e.g. ``n > 1``) is generated with those sampling parameters
too and its outputs, every sample, go to ``"samples"`` by prompt index.
OUT: ``{name: {"ok": bool, "output_ids": [[..]], "cached_tokens": [..], "samples": {idx: [[..]]},
"error": str}}``.
"""

import json
import os
import sys
import traceback


def main(spec_path: str, out_path: str) -> None:
    import sglang

    spec = json.load(open(spec_path))
    results = {}
    for run in spec["runs"]:
        kwargs = dict(
            model_path=spec["model"],
            skip_tokenizer_init=True,
            device="cpu",
            dtype="float32",
            disable_overlap_schedule=True,
            mem_fraction_static=0.3,
            max_total_tokens=4096,
            log_level="info",
            random_seed=0,
        )
        kwargs.update(run.get("engine", {}))
        os.environ.update(run.get("env", {}))
        try:
            engine = sglang.Engine(**kwargs)
        except BaseException as e:  # noqa: BLE001 - a startup failure is a result here
            results[run["name"]] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            json.dump(results, open(out_path, "w"))
            continue
        try:
            sp = {"temperature": 0, "max_new_tokens": spec["max_new_tokens"], "ignore_eos": True}
            outs = []
            # The first prompt of a shared-prefix pair must be finished before its sibling is
            # scheduled, or the radix cache cannot be hit: the spec gives waves.
            waves = spec.get("waves") or [list(range(len(spec["prompts"])))]
            by_idx, samples = {}, {}
            for wave in waves:
                if isinstance(wave, dict):  # n > 1: the samples of each prompt, one after another
                    n = wave["sampling"].get("n", 1)
                    res = engine.generate(
                        input_ids=[spec["prompts"][i] for i in wave["prompts"]],
                        sampling_params={**sp, **wave["sampling"]},
                    )
                    for k, i in enumerate(wave["prompts"]):
                        samples[str(i)] = [r["output_ids"] for r in res[k * n : (k + 1) * n]]
                    continue
                res = engine.generate(input_ids=[spec["prompts"][i] for i in wave], sampling_params=sp)
                for i, r in zip(wave, res):
                    by_idx[i] = r
            for i in range(len(spec["prompts"])):
                outs.append(by_idx[i])
            results[run["name"]] = {
                "ok": True,
                "output_ids": [o["output_ids"] for o in outs],
                "cached_tokens": [o["meta_info"].get("cached_tokens", 0) for o in outs],
                "samples": samples,
            }
        except BaseException as e:  # noqa: BLE001
            results[run["name"]] = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        finally:
            engine.shutdown()
        json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
