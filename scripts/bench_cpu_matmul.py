"""XLA:CPU matmul speed by dtype, alone and inside a layer scan, on this machine.

Shows why ``weight_dtype: bfloat16`` stores weights as 16-bit patterns: a bfloat16 dot
is several times faster than float32 on CPUs with AMX / AVX512-BF16, but stacked
bfloat16 weights inside ``lax.scan`` are slower than float32 (XLA converts the whole
stack before the loop), unless they travel as uint16 and are bitcast per layer.

    python scripts/bench_cpu_matmul.py
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def timed(f, *args, iters: int = 20) -> float:
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(f(*args))
    return (time.perf_counter() - t0) / iters


def layers(x, w1, w2, bits: bool):
    def body(h, w):
        a, b = (jax.lax.bitcast_convert_type(t, jnp.bfloat16) for t in w) if bits else w
        y = jnp.dot(h.astype(a.dtype), a, preferred_element_type=jnp.float32)
        return h + jnp.dot(y.astype(b.dtype), b, preferred_element_type=jnp.float32), None

    return jax.lax.scan(body, x, (w1, w2))[0]


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"{'m x k x n':>18} {'float32 GFLOP/s':>16} {'bfloat16 GFLOP/s':>17}")
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    for m, k, n in ((64, 576, 1536), (256, 576, 1536), (64, 576, 49152), (2048, 2048, 2048)):
        a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
        rates = [
            2 * m * k * n / timed(dot, jnp.asarray(a, dt), jnp.asarray(b, dt)) / 1e9
            for dt in (jnp.float32, jnp.bfloat16)
        ]
        print(f"{f'{m}x{k}x{n}':>18} {rates[0]:16.0f} {rates[1]:17.0f}")
    x = jnp.asarray(rng.standard_normal((64, 576)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((30, 576, 1536)) * 0.03, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((30, 1536, 576)) * 0.03, jnp.float32)
    b1, b2 = w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16)
    u1, u2 = (jax.lax.bitcast_convert_type(t, jnp.uint16) for t in (b1, b2))
    plain, bits = jax.jit(lambda *a: layers(*a, bits=False)), jax.jit(lambda *a: layers(*a, bits=True))
    print("30-layer scan, 64 rows, two 576x1536 matmuls per layer:")
    print(f"  float32 weights            {1e3 * timed(plain, x, w1, w2):7.1f} ms")
    print(f"  bfloat16 weights           {1e3 * timed(plain, x, b1, b2):7.1f} ms")
    print(f"  bfloat16 as uint16 bits    {1e3 * timed(bits, x, u1, u2):7.1f} ms")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
