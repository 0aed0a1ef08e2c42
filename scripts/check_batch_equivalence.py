"""Batch equivalence on a real model: every request alone vs all submitted together.

The issue's workload: 48 requests, prompt lengths 1..600, max_tokens 1..96, greedy,
max_num_seqs=16 and max_num_batched_tokens=64 (chunked prefill, joins/leaves every step).
Prints mismatches with the top-2 logit margin where they diverge, and the timings.

    python scripts/check_batch_equivalence.py [--model smollm2-135m-instruct] [--requests 48] [--num-pages 0]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from jaxserve import LLM, SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-prompt", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-pages", type=int, default=0, help="0 = derived; e.g. 61 forces preemption")
    ap.add_argument("--prefix-caching", action="store_true", help="off by default: this checks batching")
    args = ap.parse_args()

    opts = dict(
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=64,
        progress=False,
        enable_prefix_caching=args.prefix_caching,
    )
    if args.num_pages:
        opts["num_pages"] = args.num_pages
    llm = LLM(args.model, **opts)
    rng = random.Random(0)
    vocab = min(llm.model_config.vocab_size, 49152)
    n = args.requests
    lengths = [1, args.max_prompt] + [rng.randint(1, args.max_prompt) for _ in range(n - 2)]
    max_tokens = [args.max_tokens, 1] + [rng.randint(1, args.max_tokens) for _ in range(n - 2)]
    work = [([rng.randrange(3, vocab) for _ in range(p)], m) for p, m in zip(lengths, max_tokens, strict=True)]

    t0 = time.perf_counter()
    llm.runner.warmup(progress=False)
    compiles = llm.stats()["num_compiles"]
    t1 = time.perf_counter()
    alone = [
        llm.generate([ids], SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))[0].token_ids
        for ids, m in work
    ]
    t2 = time.perf_counter()
    reqs = [
        llm.engine.add_request(ids, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)) for ids, m in work
    ]
    while llm.engine.has_unfinished():
        llm.engine.step()
        llm.scheduler.check_integrity()
    t3 = time.perf_counter()
    batched = [r.output_token_ids for r in reqs]
    bad = [i for i in range(n) if batched[i] != alone[i]]
    stats = llm.stats()
    print(
        f"model {args.model}: {n} requests, prompts {min(lengths)}..{max(lengths)}, max_tokens {min(max_tokens)}..{max(max_tokens)}"
    )
    print(f"warm-up {t1 - t0:.1f}s; alone {t2 - t1:.1f}s; batched {t3 - t2:.1f}s ({stats['steps']} steps in all)")
    print(
        f"identical: {n - len(bad)}/{n}; preemptions {stats['num_preemptions']}; compiles after warm-up {stats['num_compiles'] - compiles}; pages free {stats['pages_free']}/{stats['pages_total']}"
    )
    for i in bad:
        j = next(k for k, (a, b) in enumerate(zip(alone[i], batched[i], strict=False)) if a != b)
        print(
            f"  request {i} (prompt {lengths[i]}): diverges at output token {j}: alone {alone[i][j]} vs batched {batched[i][j]}"
        )
    print("command: python " + " ".join(sys.argv))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
