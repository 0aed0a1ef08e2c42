"""Time one decode step (32 sequences at ~264 tokens of context) and one 256-token
prefill step of SmolLM2, with and without attention, to split a step's device time.

    python scripts/profile_step.py [--config FILE] [--set weight_dtype=bfloat16 --set kv_cache_dtype=bfloat16]

"Without attention" replaces the KV write + attention with a pass-through, so the
difference is what attention costs. Not a test: timings on shared machines are noisy.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxserve import LLM
from jaxserve.attention import AttentionBackend
from jaxserve.bench import add_engine_options, engine_config
from jaxserve.runner.batch import ScheduledSeq
from jaxserve.runner.step import greedy


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_options(ap)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    real = AttentionBackend.write_and_attend
    for stub in (False, True):
        if stub:  # a pass-through: output = q, cache unchanged
            AttentionBackend.write_and_attend = lambda self, q, k, v, kv_cache, *a, **kw: (q, kv_cache)
        llm = LLM(
            config=engine_config(args, "max_num_seqs=32", "max_num_batched_tokens=256"), progress=False, warmup=False
        )
        runner = llm.runner
        pages = [llm.kv.pool.allocate(17) for _ in range(32)]
        decode = [ScheduledSeq([5], 263, pages[i]) for i in range(32)]
        prefill = [ScheduledSeq([5] * 128, 72, pages[0]), ScheduledSeq([5] * 128, 0, pages[1])]
        times = []
        for seqs in (decode, prefill):
            runner.execute(seqs, greedy(len(seqs)))  # compile
            t0 = time.perf_counter()
            for _ in range(args.iters):
                runner.execute(seqs, greedy(len(seqs)))
            times.append((time.perf_counter() - t0) / args.iters * 1e3)
        label = "without attention" if stub else "full step        "
        print(f"{label}: decode (32 seqs) {times[0]:6.1f} ms, prefill (256 tokens) {times[1]:6.1f} ms", flush=True)
    AttentionBackend.write_and_attend = real
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
