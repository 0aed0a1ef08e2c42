"""Prefix caching off / page / token on shared-prefix workloads, in one run.

Workloads (SGLang's generated-shared-prefix shape): G system prompts x Q questions each,
all submitted at once; and a variant whose shared prefix is shorter than one page, where
only token-level matching can reuse anything. Prints prefill tokens computed, cache hit
rate and throughput for each mode.

    python scripts/bench_prefix_cache.py [--groups 4] [--questions 8] [--system-len 256] [--short-len 10]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from jaxserve import LLM, SamplingParams


def workload(groups: int, questions: int, system_len: int, question_len: int, seed: int):
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        system = [rng.randrange(3, 49152) for _ in range(system_len)]
        out += [system + [rng.randrange(3, 49152) for _ in range(question_len)] for _ in range(questions)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--short-len", type=int, default=10, help="shared prefix of the short variant (< page_size)")
    ap.add_argument("--output-len", type=int, default=16)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    workloads = {
        f"shared prefix {args.system_len}": workload(
            args.groups, args.questions, args.system_len, args.question_len, 0
        ),
        f"shared prefix {args.short_len} (< 1 page)": workload(args.groups * 2, args.questions, args.short_len, 6, 1),
    }
    print(f"model {args.model}; {args.groups} groups x {args.questions} questions; output {args.output_len} tokens")
    print(
        f"{'workload':32s} {'mode':6s} {'prefill computed':>16s} {'hit rate':>9s} {'seconds':>8s} {'total tok/s':>12s}"
    )
    for mode in ("off", "page", "token"):
        opts = {"enable_prefix_caching": False} if mode == "off" else {"prefix_match": mode}
        llm = LLM(args.model, progress=False, max_num_batched_tokens=256, max_num_seqs=32, **opts)
        llm.runner.warmup(progress=False)
        for name, prompts in workloads.items():
            before = llm.stats()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            sec = time.perf_counter() - t0
            after = llm.stats()
            computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
            hit = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
            queried = max(after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"], 1)
            total = sum(len(p) for p in prompts) + sum(len(o.token_ids) for o in outs)
            print(f"{name:32s} {mode:6s} {computed:16d} {hit / queried:9.1%} {sec:8.1f} {total / sec:12.1f}")
            if llm.scheduler.cache is not None:
                llm.scheduler.cache.evict(10**9)  # the next workload starts cold
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
