"""Offline throughput: jaxserve (continuous batching) vs the same engine in static batching
vs Hugging Face transformers `generate` with padding, on one workload, in one run.

Workload: N requests with uniformly drawn prompt and output lengths (EOS ignored so every
request produces exactly its output length). Prints output tok/s and total (prompt +
output) tok/s for each system and the ratios. Needs torch + transformers (the test extra).

    python scripts/bench_offline.py [--requests 32] [--prompt 100:300] [--output 16:128] [--hf-batch 16]

jaxserve rows (``--jaxserve``, comma-separated): ``float32`` (everything float32),
``bf16-weights`` (float32 activations, bfloat16 matmul weights) and ``bf16`` (bfloat16
matmul weights and KV cache, float32 activations, norms and softmax).
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output)) for _ in range(n)]


PRESETS = {
    "float32": {},
    "bf16-weights": {"weight_dtype": "bfloat16"},
    "bf16": {"weight_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"},
}


def bench_jaxserve(model: str, work, static: bool, args, preset: str = "float32") -> float:
    from jaxserve import LLM, SamplingParams

    options = {"min_token_bucket": args.min_token_bucket} if args.min_token_bucket else {}
    options.update(PRESETS[preset])
    llm = LLM(
        model,
        progress=False,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        static_batching=static,
        **options,
    )
    llm.runner.warmup(progress=False)
    compiles = llm.stats()["num_compiles"]
    llm.runner.timings = dict.fromkeys(llm.runner.timings, 0.0)  # count the workload only
    reqs = []
    t0 = time.perf_counter()
    for ids, m in work:
        reqs.append(llm.engine.add_request(ids, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)))
    while llm.engine.has_unfinished():
        llm.engine.step()
    elapsed = time.perf_counter() - t0
    assert [len(r.output_token_ids) for r in reqs] == [m for _, m in work]
    stats = llm.stats()
    eng, run = llm.engine.timings, llm.runner.timings
    host = eng["step_s"] - run["device_s"]
    print(
        f"  {'static' if static else 'continuous'}: {stats['steps']} steps, compiles after warm-up "
        f"{stats['num_compiles'] - compiles}; per step: {1e3 * eng['step_s'] / stats['steps']:.1f} ms, "
        f"device {1e3 * run['device_s'] / stats['steps']:.1f} ms, host {1e3 * host / stats['steps']:.2f} ms "
        f"({100 * host / eng['step_s']:.1f}%: schedule {1e3 * eng['schedule_s'] / stats['steps']:.2f}, "
        f"pack {1e3 * run['pack_s'] / stats['steps']:.2f}, update {1e3 * eng['update_s'] / stats['steps']:.2f} ms)"
    )
    return elapsed


def bench_hf(path, work, batch: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.tensor([[2] * (width - len(ids)) + ids for ids, _ in chunk])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in chunk])
        with torch.no_grad():
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=max(m for _, m in chunk),
                do_sample=False,
                pad_token_id=2,
                eos_token_id=None,
            )
    return time.perf_counter() - t0


def main() -> None:
    from jaxserve.models.fetch import fetch

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", default="100:300")
    ap.add_argument("--output", default="16:128")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--min-token-bucket", type=int, default=None)
    ap.add_argument(
        "--jaxserve",
        default="float32",
        help=f"comma-separated jaxserve rows, each one of: {', '.join(PRESETS)} (see the module docstring)",
    )
    ap.add_argument("--hf-batch", default="16", help="comma-separated batch sizes; each is timed")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-static", action="store_true")
    args = ap.parse_args()
    presets = args.jaxserve.split(",")
    for preset in presets:
        if preset not in PRESETS:
            ap.error(f"--jaxserve {preset!r}: must be one of {', '.join(PRESETS)}")
    span = lambda s: tuple(int(x) for x in s.split(":"))  # noqa: E731
    path = fetch("smollm2-135m-instruct", quiet=True)
    work = workload(args.requests, span(args.prompt), span(args.output), 49152)
    prompt_tokens = sum(len(ids) for ids, _ in work)
    output_tokens = sum(m for _, m in work)
    print(f"workload: {len(work)} requests, {prompt_tokens} prompt + {output_tokens} output tokens, SmolLM2 float32")
    results = {}
    for preset in presets:
        results[f"jaxserve (continuous batching), {preset}"] = bench_jaxserve(str(path), work, False, args, preset)
    if not args.skip_static:
        results["jaxserve (static batching)"] = bench_jaxserve(str(path), work, True, args)
    if not args.skip_hf:
        for batch in (int(b) for b in args.hf_batch.split(",")):
            results[f"transformers generate (batch {batch}, padded)"] = bench_hf(path, work, batch)
    base = next(iter(results.values()))
    print(f"{'system':50s} {'seconds':>8s} {'output tok/s':>13s} {'total tok/s':>12s} {'jaxserve is':>12s}")
    for name, sec in results.items():
        print(
            f"{name:50s} {sec:8.1f} {output_tokens / sec:13.1f} {(prompt_tokens + output_tokens) / sec:12.1f} {sec / base:11.2f}x"
        )
    hf = {name: sec for name, sec in results.items() if name.startswith("transformers")}
    if hf:
        best = min(hf.values())
        for name, sec in results.items():
            if name.startswith("jaxserve"):
                print(f"{name}: {best / sec:.2f}x the best transformers row")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
