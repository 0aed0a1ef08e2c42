"""Times ragged paged attention (and the KV write) per backend at Llama-3-8B shapes and
prints the memory bandwidth it achieves against the device's peak.

Shapes: 32 query / 8 KV heads, head_dim 128 (``--heads``), pages of 16 and 32. Workloads:
``decode``: 64 decodes at 2k context; ``mixed``: 63 of those decodes plus one 512-token
prefill chunk at the end of a 2k context; ``prefill``: one sequence's whole ``--chunk``
tokens (its context is the chunk). ``--layers N``: N layers of cache attended in turn in
one program (a lax.scan, as the model runs them; one call per program is mostly dispatch
on a CPU). "Bytes" is the KV the step must read at least once (every layer's and
sequence's K and V); achieved bandwidth = bytes / time.

    python scripts/bench_attention.py                    # the backends this platform runs
    python scripts/bench_attention.py --backends reference --context 256   # quick, on CPU
    # SmolLM2's first token's attention on the CPU kernel, its 30 layers in one program:
    python scripts/bench_attention.py --backends cpu --heads 9,3,64 --workloads prefill \
        --chunk 500 --page-sizes 16 --dtype bfloat16 --layers 30

Not a test: timings on shared machines are noisy. Prints the command line it ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.hardware import cpu_model
from pallas_kernels.ragged_paged_attention import BlockSizes, cpu, gpu, reference, tpu

# Peak HBM bandwidth (bytes/s) by device_kind substring, from vendor data sheets.
PEAK_BANDWIDTH = {
    "H200": 4.8e12,
    "H100": 3.35e12,
    "A100": 2.0e12,
    "L4": 0.3e12,
    "TPU v5 lite": 0.819e12,
    "TPU v5e": 0.819e12,
    "TPU v5p": 2.765e12,
    "TPU v5": 2.765e12,
    "TPU v4": 1.2e12,
    "TPU v6": 1.64e12,
}
MODULES = {"reference": reference, "pallas_tpu": tpu, "pallas_gpu": gpu, "cpu": cpu}


def peak_bandwidth(kind: str) -> float | None:
    for key, value in PEAK_BANDWIDTH.items():
        if key.lower() in kind.lower():
            return value
    return None


def make_batch(q_lens, context, num_heads, num_kv_heads, head_dim, page_size, dtype, cache_shape_fn, seed=0, layers=1):
    """A batch of sequences with ``q_len`` new tokens each at ``context`` tokens of KV, pages shuffled."""
    rng = np.random.default_rng(seed)
    pages_per_seq = -(-context // page_size)
    num_pages = len(q_lens) * pages_per_seq + 1
    shape = cache_shape_fn(layers, num_pages, page_size, num_kv_heads, head_dim)
    key = jax.random.key(seed)
    kv_cache = jax.random.normal(key, shape, jnp.float32).astype(dtype)
    if cache_shape_fn is cpu.get_kv_cache_shape:  # the CPU kernel holds bfloat16 as its bits
        kv_cache = jax.lax.bitcast_convert_type(kv_cache, cpu.storage_dtype(dtype))
    page_table = (rng.permutation(num_pages - 1)[: len(q_lens) * pages_per_seq] + 1).reshape(len(q_lens), -1)
    num_tokens = sum(q_lens)
    q = jax.random.normal(jax.random.fold_in(key, 1), (num_tokens, num_heads, head_dim), jnp.float32).astype(dtype)
    kv = jax.random.normal(jax.random.fold_in(key, 2), (2, num_tokens, num_kv_heads, head_dim), jnp.float32)
    slots = []
    for s, n in enumerate(q_lens):
        for pos in range(context - n, context):
            slots.append(page_table[s, pos // page_size] * page_size + pos % page_size)
    return dict(
        q=q,
        kv_cache=kv_cache,
        k=kv[0].astype(dtype),
        v=kv[1].astype(dtype),
        slot_mapping=jnp.asarray(slots, jnp.int32),
        kv_lens=jnp.full((len(q_lens),), context, jnp.int32),
        page_table=jnp.asarray(page_table, jnp.int32),
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        kv_bytes=layers * len(q_lens) * context * 2 * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize,
    )


def time_fn(fn, *args, iters: int) -> float:
    """Median seconds of ``iters`` calls after two warm-up calls (compile included in the first)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    platform = jax.default_backend()
    default = {"tpu": "reference,pallas_tpu", "gpu": "reference,pallas_gpu"}.get(platform, "reference,cpu")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=default, help="comma-separated: reference, pallas_tpu, pallas_gpu, cpu")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--num-decodes", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--page-sizes", default="16,32")
    ap.add_argument("--dtype", default="float32" if platform == "cpu" else "bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--interpret", action="store_true", help="Pallas kernels in interpret mode (tiny shapes only)")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head_dim")
    ap.add_argument("--workloads", default="decode,mixed", help="comma-separated: decode, mixed, prefill")
    ap.add_argument("--layers", type=int, default=1, help="layers of cache, attended in turn in one program")
    args = ap.parse_args()
    num_heads, num_kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    device = jax.devices()[0]
    peak = peak_bandwidth(device.device_kind)
    print(f"device: {device.device_kind} ({platform}), jax {jax.__version__}, dtype {args.dtype}")
    print(f"peak HBM bandwidth: {peak / 1e9:.0f} GB/s" if peak else "peak HBM bandwidth: unknown for this device")
    print(f"shapes: {num_heads} q heads / {num_kv_heads} KV heads, head_dim {head_dim}, context {args.context}")
    if platform == "cpu":
        print(f"cpu: {cpu_model()}")
    header = (
        f"{'workload':<8} {'page':>4} {'backend':<11} {'attention ms':>12} {'GB/s':>8} {'% peak':>7} {'write ms':>9}"
    )
    print(header)
    print("-" * len(header))
    workloads = {
        "decode": ([1] * args.num_decodes, args.context),
        "mixed": ([1] * (args.num_decodes - 1) + [args.chunk], args.context),
        "prefill": ([args.chunk], args.chunk),
    }
    for page_size in (int(p) for p in args.page_sizes.split(",")):
        for name in args.workloads.split(","):
            q_lens, context = workloads[name]
            for backend in args.backends.split(","):
                mod = MODULES[backend]
                try:
                    b = make_batch(
                        q_lens,
                        context,
                        num_heads,
                        num_kv_heads,
                        head_dim,
                        page_size,
                        args.dtype,
                        mod.get_kv_cache_shape,
                        layers=args.layers,
                    )
                    sizes = BlockSizes(block_q=16, block_pages=max(1, 128 // page_size))
                    kw = {"interpret": args.interpret} if backend.startswith("pallas") else {}
                    fn = mod.ref_ragged_paged_attention if mod is reference else mod.ragged_paged_attention

                    def layers(q, c, kl, pt, qsl, fn=fn, kw=kw, sizes=sizes):
                        # Every layer in one program, as the model's layer scan runs them.
                        def one(carry, layer):
                            out = fn(q, c, layer, kl, pt, qsl, 0, sm_scale=head_dim**-0.5, block_sizes=sizes, **kw)
                            return carry + out[0, 0, 0].astype(jnp.float32), None

                        return jax.lax.scan(one, jnp.float32(0), jnp.arange(args.layers))[0]

                    attend = jax.jit(layers)
                    write = jax.jit(
                        lambda c, s, k, v, mod=mod, kw=kw: (mod.ref_write_kv if mod is reference else mod.write_kv)(
                            c, 0, s, k, v, **kw
                        ),
                        donate_argnums=(0,),
                    )
                    t_attn = time_fn(
                        attend,
                        b["q"],
                        b["kv_cache"],
                        b["kv_lens"],
                        b["page_table"],
                        b["query_start_loc"],
                        iters=args.iters,
                    )
                    cache = b["kv_cache"].copy()
                    times = []
                    for i in range(args.iters + 2):
                        t0 = time.perf_counter()
                        cache = jax.block_until_ready(write(cache, b["slot_mapping"], b["k"], b["v"]))
                        if i >= 2:
                            times.append(time.perf_counter() - t0)
                    t_write = statistics.median(times)
                    gbs = b["kv_bytes"] / t_attn / 1e9
                    pct = f"{100 * gbs * 1e9 / peak:6.1f}%" if peak else "      -"
                    print(
                        f"{name:<8} {page_size:>4} {backend:<11} {t_attn * 1e3:>12.3f} {gbs:>8.1f} {pct:>7} {t_write * 1e3:>9.3f}",
                        flush=True,
                    )
                except Exception as e:  # report and go on: one run should show every backend's state
                    print(
                        f"{name:<8} {page_size:>4} {backend:<11} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True
                    )
    print("reproduce: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
