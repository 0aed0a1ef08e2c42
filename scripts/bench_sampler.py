"""Times the sampler program (``runner/step.py``'s ``make_sample``, as the engine calls it)
on random logits, per kind of row, whole and by chunks of rows (``sampler.by_row_chunks``),
and prints a digest of the tokens each setting drew: the chunked sampler must draw the
whole one's.

    python scripts/bench_sampler.py                         # 32 and 256 rows, whole and by 32
    python scripts/bench_sampler.py --rows 64 128 --chunks none 16 32 --vocab 128256

Each kind of row fills the batch: greedy; temperature 1; top-p 0.9; top-k 50 with top-p
0.8 at temperature 0.7; greedy with top-5 logprobs; temperature 1 with a repetition
penalty over a 264-token history (max_model_len 8192). Times are the best of ``--iters``
calls after one warm call. Not a test: timings on shared machines are noisy. Prints the
command line it ran.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.hardware import cpu_model
from jaxserve.runner.step import SeqSampling, make_sample, sampling_metadata
from jaxserve.sampling_params import SamplingParams

KINDS = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "top-p 0.9": dict(temperature=1.0, top_p=0.9),
    "top-k 50, top-p 0.8": dict(temperature=0.7, top_k=50, top_p=0.8),
    "greedy, top-5 logprobs": dict(temperature=0.0, logprobs=5),
    "repetition penalty 1.1": dict(temperature=1.0, repetition_penalty=1.1),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--chunks", nargs="+", default=["none", "32"], help="rows per chunk, or none (whole)")
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's by default")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args()
    print(f"{cpu_model()}; jax {jax.__version__} on {jax.devices()[0].platform}")
    for rows in args.rows:
        rng = np.random.default_rng(0)
        logits = jnp.asarray(3 * rng.standard_normal((rows, args.vocab)).astype(np.float32))
        feed = jnp.zeros(rows, jnp.int32)
        allowed = jnp.full((rows, (args.vocab + 31) // 32), -1, jnp.int32)
        positions = np.full(rows, 264, np.int32)
        inputs = {}
        for name, kw in KINDS.items():
            penalised = "repetition_penalty" in kw
            sampling = [
                SeqSampling(
                    SamplingParams(**kw),
                    seed=i,
                    history=rng.integers(0, args.vocab, 264).astype(np.int32) if penalised else None,
                    num_prompt_tokens=200,
                )
                for i in range(rows)
            ]
            smd, pmd = sampling_metadata(sampling, rows, positions, args.max_model_len)
            inputs[name] = (logits, smd, pmd, feed, allowed)
        for chunk in args.chunks:
            sample = jax.jit(make_sample(rows, None, None if chunk == "none" else int(chunk)))
            tokens = {}
            for name, call in inputs.items():
                out, _ = jax.block_until_ready(sample(*call))
                tokens[name] = np.asarray(out.tokens).tolist()
                times = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    jax.block_until_ready(sample(*call))
                    times.append(time.perf_counter() - t0)
                print(f"{rows:4d} rows, chunks of {chunk:>4s}: {name:24s} {min(times) * 1e3:7.2f} ms")
            digest = hashlib.sha256(repr(tokens).encode()).hexdigest()[:12]
            print(f"{rows:4d} rows, chunks of {chunk:>4s}: tokens {digest}")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
