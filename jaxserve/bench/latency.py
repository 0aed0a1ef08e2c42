"""One stream through the offline API: prefill time of a prompt and decode ms/token.

Prefix caching is turned off (every run repeats the prompt and must compute it), and
``max_num_seqs`` is 1. Timings on shared machines are noisy: run it twice.
"""

from __future__ import annotations

import argparse
import time

from jaxserve.bench import add_engine_options, at_least, engine_config, fits_context, footer


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_options(p)
    p.add_argument("--prompt-len", type=at_least(1), default=512)
    p.add_argument("--new-tokens", type=at_least(1), default=64)


def main(args: argparse.Namespace) -> int:
    import jax

    from jaxserve import LLM, SamplingParams

    cfg = engine_config(args, "enable_prefix_caching=false", "max_num_seqs=1")
    llm = LLM(config=cfg, progress=not args.quiet)
    # the first token and new_tokens more (decode's tokens after the first)
    fits_context(args.prompt_len + args.new_tokens + 1, "--prompt-len + --new-tokens + 1", llm.max_model_len)
    prompt = [(i % 1000 + 100) % llm.model_config.vocab_size for i in range(args.prompt_len)]

    def run() -> tuple[float, float]:
        """(seconds to the first token, seconds per later token) of one request, timed step
        by step (a difference of two runs' times goes negative on a busy machine)."""
        params = SamplingParams(max_tokens=args.new_tokens + 1, temperature=0.0, ignore_eos=True)
        request = llm.engine.add_request(prompt, params)
        t0 = time.perf_counter()
        while request.num_output_tokens == 0:
            llm.engine.step()
        t1 = time.perf_counter()
        while not request.status.is_finished:
            llm.engine.step()
        return t1 - t0, (time.perf_counter() - t1) / args.new_tokens

    runs = [run() for _ in range(3)]  # warmed up at construction; the best of three
    prefill, decode = min(r[0] for r in runs), min(r[1] for r in runs)
    print(
        f"platform {jax.default_backend()}, dtype {llm.plan.dtype}, weights {llm.plan.weight_dtype}, model {cfg.model}"
    )
    print(f"prefill {args.prompt_len} tokens: {prefill * 1e3:.0f} ms ({args.prompt_len / prefill:.0f} tok/s)")
    print(f"decode at batch 1: {decode * 1e3:.1f} ms/token ({1 / decode:.1f} tok/s)")
    footer(args)
    return 0
