"""Single-stream speed of the offline API on SmolLM2 (or any model): prefill and decode.

Prints what it measured and the command line that reproduces it. Not a test: timings on
shared machines are noisy.

    python scripts/bench_single_stream.py [--model smollm2-135m-instruct] [--prompt-len 512] [--new-tokens 64]
        [--weight-dtype bfloat16 --kv-cache-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--weight-dtype", default=None)
    ap.add_argument("--kv-cache-dtype", default=None)
    args = ap.parse_args()

    # No prefix caching: every run below repeats the prompt, and must compute it.
    opts = {"max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": 1, "enable_prefix_caching": False}
    for key in ("dtype", "weight_dtype", "kv_cache_dtype"):
        if getattr(args, key):
            opts[key] = getattr(args, key)
    llm = LLM(args.model, progress=False, **opts)
    prompt = [int(i) % 1000 + 100 for i in range(args.prompt_len)]
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], greedy)  # compile the prefill and decode shapes
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))

    t0 = time.perf_counter()
    llm.generate([prompt], greedy)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=args.new_tokens + 1, temperature=0.0, ignore_eos=True))
    total = time.perf_counter() - t0
    decode = (total - prefill) / args.new_tokens
    print(f"platform {llm.platform}, dtype {llm.config.dtype or 'default'}, model {args.model}")
    print(f"prefill {args.prompt_len} tokens: {prefill * 1e3:.0f} ms ({args.prompt_len / prefill:.0f} tok/s)")
    print(f"decode at batch 1: {decode * 1e3:.1f} ms/token ({1 / decode:.1f} tok/s)")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
