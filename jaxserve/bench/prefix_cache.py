"""Prefix caching off / page / token on shared-prefix workloads, in one run.

Workloads (SGLang's generated-shared-prefix shape): G system prompts x Q questions each,
all submitted at once; and a variant whose shared prefix is shorter than one page, where
only token-level matching can reuse anything. Prints prefill tokens computed, cache hit
rate and throughput for each mode.
"""

from __future__ import annotations

import argparse
import random
import time

from jaxserve.bench import add_engine_options, at_least, engine_config, fits_context, footer

MODES = {"off": "enable_prefix_caching=false", "page": "prefix_match=page", "token": "prefix_match=token"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_options(p)
    p.add_argument("--groups", type=at_least(1), default=4)
    p.add_argument("--questions", type=at_least(1), default=8)
    p.add_argument("--system-len", type=at_least(1), default=256)
    p.add_argument("--question-len", type=at_least(1), default=24)
    p.add_argument("--short-len", type=at_least(1), default=10, help="shared prefix of the short variant (< page_size)")
    p.add_argument("--output-len", type=at_least(1), default=16)


def workload(groups: int, questions: int, system_len: int, question_len: int, vocab: int, seed: int):
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        system = [rng.randrange(3, vocab) for _ in range(system_len)]
        out += [system + [rng.randrange(3, vocab) for _ in range(question_len)] for _ in range(questions)]
    return out


def main(args: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    print(f"{args.groups} groups x {args.questions} questions; output {args.output_len} tokens")
    print(
        f"{'workload':32s} {'mode':6s} {'prefill computed':>16s} {'hit rate':>9s} {'seconds':>8s} {'total tok/s':>12s}"
    )
    for mode, setting in MODES.items():
        llm = LLM(config=engine_config(args, setting), progress=not args.quiet)
        vocab = llm.model_config.vocab_size
        workloads = {
            f"shared prefix {args.system_len}": workload(
                args.groups, args.questions, args.system_len, args.question_len, vocab, 0
            ),
            f"shared prefix {args.short_len} (< 1 page)": workload(
                args.groups * 2, args.questions, args.short_len, 6, vocab, 1
            ),
        }
        longest = max(len(p) for prompts in workloads.values() for p in prompts) + args.output_len
        fits_context(longest, "the longest request (prompt + --output-len)", llm.max_model_len)
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
            print(
                f"{name:32s} {mode:6s} {computed:16d} {hit / queried:9.1%} {sec:8.1f} {total / sec:12.1f}", flush=True
            )
            llm.kv.clear_cache()  # the next workload starts cold
        del llm
    footer(args)
    return 0
