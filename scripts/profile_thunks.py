"""Where one step's device time goes, per XLA thunk (each fusion, each FFI call), summed
over the layers: a 500-token prefill of one sequence, or a decode of 32 sequences.

    XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true JAX_PLATFORMS=cpu \
        python scripts/profile_thunks.py [--mode prefill|decode] [--set weight_dtype=bfloat16 ...]

The names are the optimized HLO's (add ``--xla_dump_to=DIR`` to XLA_FLAGS to read which
op each is: ``ffi_call.N`` with ``custom_call_target="jaxserve_matmul"`` is a linear layer,
``jaxserve_ragged_paged_attention`` attention). Thunks on the two threads may overlap, so
the sum can exceed the step. Not a test: timings on shared machines are noisy.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import tempfile
import time

import jax
from jax.profiler import ProfileData

from jaxserve import LLM
from jaxserve.bench import add_engine_options, engine_config
from jaxserve.runner.batch import ScheduledSeq
from jaxserve.runner.step import greedy


def main() -> None:
    ap = argparse.ArgumentParser()
    add_engine_options(ap)
    ap.add_argument("--mode", choices=("prefill", "decode"), default="prefill")
    ap.add_argument("--tokens", type=int, default=500, help="prefill length")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    llm = LLM(config=engine_config(args, "max_num_seqs=32", "max_num_batched_tokens=512"), progress=False, warmup=False)
    runner = llm.runner
    pages = [llm.kv.pool.allocate(40) for _ in range(32)]
    if args.mode == "prefill":
        seqs = [ScheduledSeq([5] * args.tokens, 0, pages[0])]
    else:
        seqs = [ScheduledSeq([5], 263, pages[i]) for i in range(32)]
    for _ in range(3):
        runner.execute(seqs, greedy(len(seqs)))
    t0 = time.perf_counter()
    for _ in range(args.iters):
        runner.execute(seqs, greedy(len(seqs)))
    step_ms = (time.perf_counter() - t0) / args.iters * 1e3
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(args.iters):
                runner.execute(seqs, greedy(len(seqs)))
        profile = ProfileData.from_file(str(next(pathlib.Path(d).rglob("*.xplane.pb"))))
    total, count = collections.Counter(), collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            if "Eigen" not in line.name and "PjRtCpuClient" not in line.name:
                continue
            for ev in line.events:
                if not ev.name.startswith(("ThunkExecutor", "end: ")):
                    total[ev.name] += ev.duration_ns
                    count[ev.name] += 1
    if not total:
        sys.exit("no thunk events: run with XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true")
    print(f"{args.mode}: {step_ms:.1f} ms a step (untraced); per step, summed over layers:")
    for name, ns in total.most_common(args.top):
        print(f"  {ns / args.iters / 1e6:8.2f} ms  {count[name] / args.iters:5.0f}x  {name}")
    print(f"  {sum(total.values()) / args.iters / 1e6:8.2f} ms  in all")
    print("command: XLA_FLAGS=--xla_cpu_enable_xprof_traceme=true python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
