"""The int8-weight AMX kernel (``pallas_kernels.cpu_int8``) against numpy and XLA's path,
and a token's output independent of its batch (a CPU with AMX only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.models.llama import dot
from jaxserve.models.quant import dequantize, int8_dot
from pallas_kernels import cpu_int8

pytestmark = pytest.mark.skipif(not cpu_int8.available(), reason="needs a CPU with AMX")

K, N, L = 96, 80, 3
LAYOUTS = {"per-channel": (1, False), "groups": (K // 32, False), "groups+offsets": (K // 32, True)}


def _weights(groups: int, offset: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, (L, K, N)).astype(np.int8)
    dtype = np.float32 if groups == 1 else np.float16  # as loading holds them
    scale = (0.01 + 0.02 * rng.random((L, groups, N))).astype(dtype)
    off = (0.01 * rng.standard_normal((L, groups, N))).astype(np.float16) if offset else None
    blobs = np.stack([cpu_int8.pack(q[i], scale[i], None if off is None else off[i]) for i in range(L)])
    return q, scale, off, jnp.asarray(blobs)


def _kernel(x, blobs, layer, groups, offset):
    return np.asarray(jax.jit(lambda x, b: cpu_int8.matmul(x, b, layer, K, N, K // groups, offset))(x, blobs))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("m", [1, 5, 16, 37])
def test_matches_the_weights_it_stands_for(layout, m):
    """x @ w for the layer asked, w as XLA's path rebuilds it (bfloat16), to float32 rounding."""
    groups, offset = LAYOUTS[layout]
    q, scale, off, blobs = _weights(groups, offset)
    x = np.random.default_rng(m).standard_normal((m, K)).astype(ml_dtypes.bfloat16)
    layer = 2
    w = dequantize(q[layer], scale[layer], None if off is None else off[layer])
    w = w.astype(ml_dtypes.bfloat16).astype(np.float64) if groups > 1 else w.astype(np.float64)
    expected = x.astype(np.float64) @ w
    got = _kernel(jnp.asarray(x), blobs, layer, groups, offset)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # XLA's int8 path (bfloat16 dots) computes the same weights in another summation order
    xla = int8_dot(
        jnp.asarray(x),
        jnp.asarray(q[layer]),
        jnp.asarray(scale[layer]),
        None if off is None else jnp.asarray(off[layer]),
        jnp.bfloat16,
        dot,
    )
    np.testing.assert_allclose(got, np.asarray(xla), rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_row_does_not_depend_on_the_rows_beside_it(layout):
    groups, offset = LAYOUTS[layout]
    _, _, _, blobs = _weights(groups, offset, seed=4)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((45, K)).astype(ml_dtypes.bfloat16))
    whole = _kernel(x, blobs, 1, groups, offset)
    for rows in ([0], [17, 18, 19], list(range(31, 45))):
        np.testing.assert_array_equal(_kernel(x[jnp.asarray(rows)], blobs, 1, groups, offset), whole[rows])


def test_a_blob_of_the_wrong_size_is_refused_by_name():
    _, _, _, blobs = _weights(1, False)
    with pytest.raises(Exception, match=r"blob holds \d+ bytes per layer; a \[96, 64\] int8 weight takes"):
        jax.jit(lambda x, b: cpu_int8.matmul(x, b, 0, K, 64, K, False))(jnp.ones((2, K), jnp.bfloat16), blobs)
    with pytest.raises(ValueError, match="K % 32 == 0, N % 16 == 0"):
        cpu_int8.blob_bytes(40, 16, 40, False)
