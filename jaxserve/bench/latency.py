"""One stream through the offline API: prefill time of a prompt and decode ms/token.

Prefix caching is turned off (every run repeats the prompt and must compute it), and
``max_num_seqs`` is 1. Timings on shared machines are noisy: run it twice.
"""

from __future__ import annotations

import argparse
import time

from jaxserve.bench import add_engine_options, engine_config, footer


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_options(p)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)


def main(args: argparse.Namespace) -> int:
    import jax

    from jaxserve import LLM, SamplingParams

    cfg = engine_config(args, "enable_prefix_caching=false", "max_num_seqs=1")
    llm = LLM(config=cfg, progress=not args.quiet)
    prompt = [i % 1000 + 100 for i in range(args.prompt_len)]

    def run(max_tokens: int) -> float:
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t0

    run(1), run(2)  # compile the prefill and decode shapes
    prefill = run(1)
    decode = (run(args.new_tokens + 1) - prefill) / args.new_tokens
    print(
        f"platform {jax.default_backend()}, dtype {llm.plan.dtype}, weights {llm.plan.weight_dtype}, model {cfg.model}"
    )
    print(f"prefill {args.prompt_len} tokens: {prefill * 1e3:.0f} ms ({args.prompt_len / prefill:.0f} tok/s)")
    print(f"decode at batch 1: {decode * 1e3:.1f} ms/token ({1 / decode:.1f} tok/s)")
    footer(args)
    return 0
