"""Ragged paged attention: the pure-JAX reference against a naive per-sequence numpy
attention, and the Pallas TPU / GPU kernels (interpret mode on CPU) against the reference.

Table-driven over (q_len, kv_len) cases; unused pages and padding are NaN so a stray read
shows up as NaN in the output.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.attention import AttentionBackend, AttentionMetadata
from pallas_kernels import cpu_build
from pallas_kernels.ragged_paged_attention import (
    BlockSizes,
    cpu,
    get_kv_cache_shape,
    gpu,
    ref_ragged_paged_attention,
    ref_write_kv,
    reference,
    tpu,
)
from pallas_kernels.ragged_paged_attention.common import QkvProduct, QuantizedKV, quantize_rows

CASES = {
    "decode_only": [(1, 1), (1, 17), (1, 40), (1, 5)],
    "prefill_only": [(23, 23), (7, 7)],
    "mixed": [(1, 33), (12, 20), (1, 9), (16, 16)],
    "random": None,
}


def _naive(q, k_seq, v_seq, kv_len, window):
    """q [n, Hq, D]; k/v [kv_len, Hkv, D]: causal (optionally windowed) attention."""
    n, hq, d = q.shape
    group = hq // k_seq.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for i in range(n):
        pos = kv_len - n + i
        lo = max(0, pos - window + 1) if window else 0
        for h in range(hq):
            kk, vv = k_seq[lo : pos + 1, h // group], v_seq[lo : pos + 1, h // group]
            s = kk.astype(np.float64) @ q[i, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vv
    return out


@dataclasses.dataclass
class Case:
    kv_cache: np.ndarray  # cached tokens written, everything else NaN
    q: np.ndarray
    k_new: np.ndarray
    v_new: np.ndarray
    slot_mapping: np.ndarray
    kv_lens: np.ndarray
    page_table: np.ndarray
    query_start_loc: np.ndarray
    num_real_tokens: int
    num_written: int
    expected: np.ndarray  # naive attention of the real tokens


def make_case(seqs, num_heads, num_kv_heads, head_dim, *, window=0, page_size=4, cache_shape_fn=get_kv_cache_shape):
    """A ragged batch of ``seqs`` = [(q_len, kv_len)], one padding sequence and 3 padding
    tokens, pages scattered at random through a NaN-filled cache (layer 1 of 2)."""
    rng = np.random.RandomState(0)
    pages_per_seq = max(-(-kv // page_size) for _, kv in seqs) + 1
    num_pages = len(seqs) * pages_per_seq + 2
    kv_cache = np.full(cache_shape_fn(2, num_pages, page_size, num_kv_heads, head_dim), np.nan, np.float32)
    free = list(rng.permutation(np.arange(1, num_pages)))
    num_tokens = sum(q for q, _ in seqs) + 3  # 3 padding tokens
    q_all = np.full((num_tokens, num_heads, head_dim), np.nan, np.float32)
    page_table = np.zeros((len(seqs) + 1, pages_per_seq), np.int32)  # + one padding sequence
    qsl, kv_lens, new_k, new_v, slots, expected = [0], [], [], [], [], []
    for s, (q_len, kv_len) in enumerate(seqs):
        pages = [free.pop() for _ in range(-(-kv_len // page_size))]
        page_table[s, : len(pages)] = pages
        k_seq = rng.randn(kv_len, num_kv_heads, head_dim).astype(np.float32)
        v_seq = rng.randn(kv_len, num_kv_heads, head_dim).astype(np.float32)
        q = rng.randn(q_len, num_heads, head_dim).astype(np.float32)
        for pos in range(kv_len):
            slot = pages[pos // page_size] * page_size + pos % page_size
            if pos < kv_len - q_len:  # cached before this step
                kv = np.concatenate([k_seq[pos], v_seq[pos]])
                kv_cache[:, 1, slot // page_size, slot % page_size] = 0.0
                kv_cache[:, 1, slot // page_size, slot % page_size, :head_dim] = kv
            else:  # written by this step
                new_k.append(k_seq[pos]), new_v.append(v_seq[pos]), slots.append(slot)
        q_all[qsl[-1] : qsl[-1] + q_len] = q
        qsl.append(qsl[-1] + q_len)
        kv_lens.append(kv_len)
        expected.append(_naive(q, k_seq, v_seq, kv_len, window))
    qsl.append(qsl[-1])
    kv_lens.append(0)
    q_all[qsl[-1] :] = 0.0  # padding queries are finite; their rows must come out zero
    pad = num_tokens - len(slots)
    zeros = np.zeros((pad, num_kv_heads, head_dim), np.float32)
    return Case(
        kv_cache=kv_cache,
        q=q_all,
        k_new=np.concatenate([np.stack(new_k), zeros]),
        v_new=np.concatenate([np.stack(new_v), zeros]),
        slot_mapping=np.asarray(slots + [0] * pad, np.int32),
        kv_lens=np.asarray(kv_lens, np.int32),
        page_table=page_table,
        query_start_loc=np.asarray(qsl, np.int32),
        num_real_tokens=qsl[-1],
        num_written=len(slots),
        expected=np.concatenate(expected),
    )


def _case_seqs(case):
    rng = np.random.RandomState(0)
    return CASES[case] or [(q, q + rng.randint(0, 30)) for q in rng.randint(1, 12, size=5)]


_UNOPTIMIZED: dict[tuple, jax.stages.Compiled] = {}


def _unoptimized(fn, interpret: bool):
    """``fn`` compiled by XLA:CPU without LLVM's optimizer, for a Pallas kernel in interpret
    mode and for the reference (the oracle): what these tests check is a kernel's logic,
    not XLA's code. An interpreted kernel is a large program of loops (~30% of these tests'
    time went to optimizing it); the reference's tiled loops took ~1.5 s to compile at each
    shape, ~0.9 s without. A program is kept by its arguments' shapes and dtypes, so the
    oracle of one case shape compiles once for all the kernels and dtypes checked against
    it. The C++ CPU kernel is called as it is (a custom call: its code is the same either
    way). The engine's tests compile every backend as it serves."""
    if not interpret and fn not in (ref_write_kv, ref_ragged_paged_attention):
        return fn

    def call(*args, **static):
        leaves, tree = jax.tree.flatten(args)
        key = (fn, interpret, tuple(sorted(static.items())), tree, tuple((x.shape, x.dtype) for x in leaves))
        if key not in _UNOPTIMIZED:
            jitted = jax.jit(functools.partial(fn, **static, **({"interpret": True} if interpret else {})))
            lowered = jitted.lower(*args)
            _UNOPTIMIZED[key] = lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
        return _UNOPTIMIZED[key](*args)

    return call


def _write(write, c: Case, interpret=False):
    """``c``'s new K/V written into its cache (layer 1)."""
    return _unoptimized(write, interpret)(c.kv_cache, np.int32(1), c.slot_mapping, c.k_new, c.v_new)


def _run(write, attend, c: Case, window, block_sizes, interpret=False):
    cache = _write(write, c, interpret)
    args = (c.q, cache, np.int32(1), c.kv_lens, c.page_table, c.query_start_loc, np.int32(window))
    out = _unoptimized(attend, interpret)(*args, sm_scale=c.q.shape[2] ** -0.5, block_sizes=block_sizes)
    return jax.tree.map(np.asarray, cache), np.asarray(out)  # an 8-bit cache: QuantizedKV of arrays


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
@pytest.mark.parametrize("window, block_q", [(0, 16), (6, 4)])
def test_reference_matches_naive(case, num_heads, num_kv_heads, head_dim, window, block_q):
    c = make_case(_case_seqs(case), num_heads, num_kv_heads, head_dim, window=window)
    cache, out = _run(ref_write_kv, ref_ragged_paged_attention, c, window, BlockSizes(block_q=block_q, block_pages=2))
    np.testing.assert_allclose(out[: c.num_real_tokens], c.expected, atol=2e-5, rtol=1e-5)
    assert np.all(out[c.num_real_tokens :] == 0)
    # Layer 0 untouched (still all NaN); layer 1's written slots hold exactly the new K/V.
    assert np.isnan(cache[:, 0]).all()
    slots = c.slot_mapping[: c.num_written]
    written = cache[:, 1, slots // 4, slots % 4].transpose(1, 0, 2)  # [2*Hkv, n, D] -> [n, 2*Hkv, D]
    np.testing.assert_array_equal(written, np.concatenate([c.k_new, c.v_new], axis=1)[: c.num_written])


def test_reference_bfloat16_cache_is_held_as_bits():
    """A bfloat16 cache lives as uint16 bit patterns; reading and writing it gives exactly
    what a float32 cache holding the same bfloat16-rounded values gives."""
    c = make_case(_case_seqs("mixed"), 9, 3, 64)
    assert reference.storage_dtype(jnp.bfloat16) == jnp.uint16
    assert reference.storage_dtype(jnp.float32) == jnp.float32
    as_bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    bits = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(c.kv_cache, jnp.bfloat16), jnp.uint16))
    sizes = BlockSizes(block_q=4, block_pages=2)
    cache_bits, out_bits = _run(
        ref_write_kv, ref_ragged_paged_attention, dataclasses.replace(c, kv_cache=bits), 0, sizes
    )
    rounded = dataclasses.replace(c, kv_cache=as_bf16(c.kv_cache), k_new=as_bf16(c.k_new), v_new=as_bf16(c.v_new))
    cache_f32, out_f32 = _run(ref_write_kv, ref_ragged_paged_attention, rounded, 0, sizes)
    assert cache_bits.dtype == np.uint16
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(cache_bits, jnp.bfloat16), np.float32), cache_f32
    )
    np.testing.assert_array_equal(out_bits, out_f32)
    np.testing.assert_allclose(out_bits[: c.num_real_tokens], c.expected, atol=5e-2)  # bfloat16 K/V rounding


def test_extra_kv_blocks_do_not_change_a_token_bitwise():
    """A decode's output is bit-identical whether the batch's longest sequence is short or long."""
    rng = np.random.RandomState(1)
    page_size, d = 4, 16
    cache = rng.randn(*get_kv_cache_shape(1, 32, page_size, 2, d)).astype(np.float32)
    q = rng.randn(2, 4, d).astype(np.float32)
    pt = np.arange(1, 17, dtype=np.int32).reshape(2, 8)
    args = {"sm_scale": 0.25, "block_sizes": BlockSizes(block_q=4, block_pages=1)}
    alone = ref_ragged_paged_attention(
        q[:1], cache, np.int32(0), np.asarray([5, 0], np.int32), pt, np.asarray([0, 1, 1], np.int32), 0, **args
    )
    with_long = ref_ragged_paged_attention(
        q, cache, np.int32(0), np.asarray([5, 30], np.int32), pt, np.asarray([0, 1, 2], np.int32), 0, **args
    )
    np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(with_long)[0])


KERNELS = {"pallas_tpu": tpu, "pallas_gpu": gpu}
# scripts/device_check.sh sets JAXSERVE_NATIVE_KERNELS=1 on an accelerator: the kernel of
# that platform then runs natively (not interpreted) against the reference on the device.
NATIVE = os.environ.get("JAXSERVE_NATIVE_KERNELS") == "1"
if NATIVE:
    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 in the reference
    KERNELS = {k: m for k, m in KERNELS.items() if k == {"tpu": "pallas_tpu"}.get(jax.default_backend(), "pallas_gpu")}
# (q heads, KV heads, head_dim, page_size): GQA ratios 3 (SmolLM2, odd KV heads), 1, 4, 8;
# head_dim 64 and 128; pages of 16 and 32.
KERNEL_SHAPES = [(9, 3, 64, 16), (4, 4, 128, 32), (8, 2, 64, 32), (8, 1, 128, 16)]
KERNEL_CASES = {
    "decode_only": [(1, 1), (1, 70), (1, 33), (1, 5)],
    "prefill_only": [(40, 40), (7, 7)],
    "mixed": [(1, 97), (20, 60), (1, 9), (16, 16)],
    "random": None,
}


def _kernel_case_seqs(case):
    rng = np.random.RandomState(1)
    return KERNEL_CASES[case] or [(q, q + rng.randint(0, 80)) for q in rng.randint(1, 30, size=4)]


def _check_kernel(mod, c: Case, window, block_sizes, *, atol, rtol):
    ref_cache, ref_out = _run(ref_write_kv, ref_ragged_paged_attention, c, window, block_sizes)
    cache, out = _run(mod.write_kv, mod.ragged_paged_attention, c, window, block_sizes, interpret=not NATIVE)
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    np.testing.assert_allclose(
        out[: c.num_real_tokens].astype(np.float32),
        ref_out[: c.num_real_tokens].astype(np.float32),
        atol=atol,
        rtol=rtol,
    )
    assert np.all(out[c.num_real_tokens :] == 0)
    # The written pages match exactly; page 0 is scratch, where padding tokens race.
    np.testing.assert_array_equal(cache[:, :, 1:].astype(np.float32), ref_cache[:, :, 1:].astype(np.float32))


# Interpret mode is slow (10-17 s a case on 2 cores of a Zen 3, ~2 s on an AMX Xeon): the
# Pallas kernels get the batches that hold both decodes and chunks, each batch on two of
# the shapes (between them both head_dims and both page sizes), every pair natively on a
# device. Decode-only and prefill-only steps differ only in which plan the shared wrapper
# skips (common.attend_by_plan), checked on the reference and the C++ kernel.
SHAPE_CASES = [
    (*shape, case)
    for i, shape in enumerate(KERNEL_SHAPES)
    for case in (("mixed", "random") if NATIVE else (("mixed", "random")[i // 2],))
]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, page_size, case", SHAPE_CASES)
def test_kernel_matches_reference(kernel, case, num_heads, num_kv_heads, head_dim, page_size):
    mod = KERNELS[kernel]
    c = make_case(
        _kernel_case_seqs(case),
        num_heads,
        num_kv_heads,
        head_dim,
        page_size=page_size,
        cache_shape_fn=mod.get_kv_cache_shape,
    )
    _check_kernel(mod, c, 0, BlockSizes(block_q=16, block_pages=2), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_sliding_window_and_small_blocks(kernel):
    mod = KERNELS[kernel]
    c = make_case(_kernel_case_seqs("mixed"), 9, 3, 64, window=20, page_size=16, cache_shape_fn=mod.get_kv_cache_shape)
    _check_kernel(mod, c, 20, BlockSizes(block_q=8, block_pages=1), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_bfloat16(kernel):
    import ml_dtypes

    mod = KERNELS[kernel]
    c = make_case(_kernel_case_seqs("mixed"), 8, 2, 64, page_size=16, cache_shape_fn=mod.get_kv_cache_shape)
    bf16 = ml_dtypes.bfloat16
    c = dataclasses.replace(
        c,
        kv_cache=c.kv_cache.astype(bf16),
        q=c.q.astype(bf16),
        k_new=c.k_new.astype(bf16),
        v_new=c.v_new.astype(bf16),
    )
    _check_kernel(mod, c, 0, BlockSizes(block_q=16, block_pages=2), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_rejects_bad_inputs_by_name(kernel):
    mod = KERNELS[kernel]
    c = make_case([(1, 5)], 4, 2, 64, page_size=16, cache_shape_fn=mod.get_kv_cache_shape)
    args = (c.kv_lens, c.page_table, c.query_start_loc)
    with pytest.raises(ValueError, match="q has 3 heads"):
        mod.ragged_paged_attention(c.q[:, :3], c.kv_cache, 1, *args, sm_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="query_start_loc must be"):
        mod.ragged_paged_attention(c.q, c.kv_cache, 1, c.kv_lens, c.page_table, c.query_start_loc[:-1], sm_scale=1.0)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        mod.write_kv(c.kv_cache, 1, c.slot_mapping[:-1], c.k_new, c.v_new, interpret=True)
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        BlockSizes(block_q=0)


# The C++ CPU kernel (cpu.py): runs natively here, so it is checked at every shape.
needs_cpu_kernel = pytest.mark.skipif(
    not cpu.available(), reason="the CPU kernel cannot be built here (no C++ compiler?)"
)


@needs_cpu_kernel
@pytest.mark.parametrize("case", list(KERNEL_CASES))
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, page_size", [*KERNEL_SHAPES, (4, 2, 8, 4)])
@pytest.mark.parametrize("window", [0, 20])
def test_cpu_kernel_matches_naive(case, num_heads, num_kv_heads, head_dim, page_size, window):
    c = make_case(_kernel_case_seqs(case), num_heads, num_kv_heads, head_dim, window=window, page_size=page_size)
    cache, out = _run(cpu.write_kv, cpu.ragged_paged_attention, c, window, BlockSizes())
    np.testing.assert_allclose(out[: c.num_real_tokens], c.expected, atol=2e-5, rtol=1e-5)
    assert np.all(out[c.num_real_tokens :] == 0)
    ref_cache = np.asarray(_write(ref_write_kv, c))
    np.testing.assert_array_equal(cache[:, :, 1:], ref_cache[:, :, 1:])


@needs_cpu_kernel
def test_cpu_kernel_bfloat16_bits_cache():
    c = make_case(_kernel_case_seqs("mixed"), 9, 3, 64, page_size=16)
    bits = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(c.kv_cache, jnp.bfloat16), jnp.uint16))
    cache, out = _run(cpu.write_kv, cpu.ragged_paged_attention, dataclasses.replace(c, kv_cache=bits), 0, BlockSizes())
    assert cache.dtype == np.uint16
    np.testing.assert_allclose(out[: c.num_real_tokens], c.expected, atol=3e-2)  # bfloat16 K/V rounding


@needs_cpu_kernel
@pytest.mark.parametrize("case", list(KERNEL_CASES))
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, page_size", [*KERNEL_SHAPES, (4, 2, 32, 8)])
@pytest.mark.parametrize("window", [0, 20])
def test_cpu_kernel_bfloat16_cache_is_read_at_float32_accuracy(
    case, num_heads, num_kv_heads, head_dim, page_size, window
):
    """A bfloat16 cache gives what a float32 cache holding the same values gives, to ~1e-5:
    on AMX the query and the probabilities enter the bfloat16 tile products as hi + lo
    pairs (hi alone would be ~1e-3 off), elsewhere the values are widened exactly."""
    c = make_case(_kernel_case_seqs(case), num_heads, num_kv_heads, head_dim, window=window, page_size=page_size)
    as_bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    c = dataclasses.replace(c, kv_cache=as_bf16(c.kv_cache), k_new=as_bf16(c.k_new), v_new=as_bf16(c.v_new))
    bits = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(c.kv_cache, jnp.bfloat16), jnp.uint16))
    _, out_f32 = _run(cpu.write_kv, cpu.ragged_paged_attention, c, window, BlockSizes())
    _, out_bits = _run(
        cpu.write_kv, cpu.ragged_paged_attention, dataclasses.replace(c, kv_cache=bits), window, BlockSizes()
    )
    np.testing.assert_allclose(out_bits, out_f32, atol=2e-5, rtol=2e-5)
    assert np.all(out_bits[c.num_real_tokens :] == 0)


def _qkv_product(t: int, seed: int = 5) -> QkvProduct:
    """[q | k | v] = 15 heads of 64 (9 + 3 + 3) as 2 slices of 480 columns: q's head 7 has
    32 columns in each."""
    rng = np.random.RandomState(seed)
    product = jnp.asarray(rng.randn(2, t, 480).astype(np.float32))
    angles = rng.uniform(0, 100, (t, 32))
    cos = jnp.asarray(np.cos(np.concatenate([angles, angles], -1)), jnp.float32)
    sin = jnp.asarray(np.sin(np.concatenate([angles, angles], -1)), jnp.float32)
    return QkvProduct(product, cos, sin, 9, 3)


def _fma_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's rotation of x ``[T, H, D]`` in numpy, fma(x, cos, rotate_half(x) *
    sin): x * cos exact in float64, the sum rounded twice (to float64, to float32); and
    where that sum was exact in float64 (TwoSum), so that the result is the fma's."""
    half = x.shape[-1] // 2
    rs = (np.concatenate([-x[..., half:], x[..., :half]], -1) * sin[:, None]).astype(np.float32).astype(np.float64)
    xc = x.astype(np.float64) * cos[:, None].astype(np.float64)
    total = xc + rs
    rest = total - xc
    exact = ((xc - (total - rest)) + (rs - rest)) == 0
    return total.astype(np.float32), exact


@needs_cpu_kernel
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8"])
def test_cpu_kernel_reads_a_qkv_product(cache_dtype):
    """A QkvProduct (q, k, v unrotated inside a linear layer's product by column slices)
    gives what its materialized q, k and v (XLA's RoPE, the reference's scatter) give:
    write_and_attend's cache and output, ragged_paged_attention's output, heads split
    across slices included (to XLA's rounding: its fusions contract x * cos into the sum
    or not, case by case); keys are rotated as fma(x, cos, rotate_half(x) * sin), bit for
    bit. The reference backend, which cannot read a product, gets it materialized."""
    c = make_case(_kernel_case_seqs("mixed"), 9, 3, 64, page_size=16)
    cache = jnp.asarray(c.kv_cache)
    if cache_dtype == "bfloat16":
        cache = jax.lax.bitcast_convert_type(cache.astype(jnp.bfloat16), jnp.uint16)
    elif cache_dtype == "int8":
        cache = QuantizedKV(*quantize_rows(jnp.nan_to_num(cache), "int8"))
    t = c.q.shape[0]
    qkv = _qkv_product(t)
    q = jax.jit(QkvProduct.query)(qkv)
    k, v = jax.jit(QkvProduct.keys_values)(qkv)
    assert q.shape == qkv.shape == (t, 9, 64) and k.shape == v.shape == (t, 3, 64)
    md = (c.kv_lens, c.page_table, c.query_start_loc, np.int32(0))
    expected_cache = jax.jit(cpu.write_kv)(cache, np.int32(1), c.slot_mapping, k, v)
    expected = cpu.ragged_paged_attention(q, expected_cache, np.int32(1), *md, sm_scale=0.125)
    out, written = cpu.write_and_attend(qkv, cache, np.int32(1), c.slot_mapping, *md, sm_scale=0.125)
    close = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, expected, **close)
    np.testing.assert_allclose(cpu.ragged_paged_attention(qkv, written, np.int32(1), *md, sm_scale=0.125), out)
    for got, want in zip(jax.tree.leaves(written), jax.tree.leaves(expected_cache), strict=True):
        got, want = np.asarray(got)[:, :, 1:], np.asarray(want)[:, :, 1:]  # page 0: scratch
        if cache_dtype == "bfloat16":  # a rounding apart at most
            assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1
        else:
            np.testing.assert_allclose(got, want, **close)
    if cache_dtype != "float32":
        return
    # The keys the kernel stored, bit for bit.
    real = c.num_written
    slots = c.slot_mapping[:real]
    stored = np.asarray(written)[:3, 1, slots // 16, slots % 16]  # [Hkv, tokens, D]
    p = np.asarray(qkv.product).transpose(1, 0, 2).reshape(t, 960)[:real, 576:768].reshape(real, 3, 64)
    want, exact = _fma_rope(p, np.asarray(qkv.cos)[:real], np.asarray(qkv.sin)[:real])
    assert exact.mean() > 0.9
    np.testing.assert_array_equal(stored.transpose(1, 0, 2)[exact], want[exact])
    backend = AttentionBackend.resolve("reference", page_size=16)
    meta = AttentionMetadata(
        *(jnp.asarray(c.slot_mapping),) * 3,
        c.query_start_loc,
        c.kv_lens,
        c.page_table,
        jnp.zeros(len(c.kv_lens), jnp.int32),
    )
    ref_product, ref_cache = backend.write_and_attend_product(
        qkv, cache, jnp.int32(1), meta, jnp.int32(0), sm_scale=0.125
    )
    ref_plain, ref_plain_cache = backend.write_and_attend(
        q, k, v, cache, jnp.int32(1), meta, jnp.int32(0), sm_scale=0.125
    )
    np.testing.assert_allclose(ref_product, ref_plain, **close)
    np.testing.assert_allclose(ref_cache, ref_plain_cache, **close)


@needs_cpu_kernel
def test_cpu_write_and_attend_rejects_a_slot_outside_the_cache():
    c = make_case([(3, 5)], 9, 3, 64, page_size=16)
    slots = c.slot_mapping.copy()
    slots[1] = c.kv_cache.shape[2] * 16  # one past the last slot
    with pytest.raises(Exception, match=r"slot_mapping\[1\] = .* is not a slot of the cache"):
        cpu.write_and_attend(
            _qkv_product(c.q.shape[0]), jnp.asarray(c.kv_cache), np.int32(1), slots,
            c.kv_lens, c.page_table, c.query_start_loc, np.int32(0), sm_scale=0.125,
        )  # fmt: skip


@needs_cpu_kernel
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_cpu_kernel_bfloat16_output_is_its_float32_output_rounded(cache_dtype):
    """``out_dtype=bfloat16`` (what a bfloat16 o_proj reads) stores each value as XLA's
    cast of the float32 output would, bit for bit, and padding rows as zeros."""
    c = make_case(_kernel_case_seqs("mixed"), 9, 3, 64, page_size=16)
    if cache_dtype == "bfloat16":
        bits = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(c.kv_cache, jnp.bfloat16), jnp.uint16))
        c = dataclasses.replace(c, kv_cache=bits)
    attend_bf16 = functools.partial(cpu.ragged_paged_attention, out_dtype=jnp.bfloat16)
    _, out_f32 = _run(cpu.write_kv, cpu.ragged_paged_attention, c, 0, BlockSizes())
    _, out_bf16 = _run(cpu.write_kv, attend_bf16, c, 0, BlockSizes())
    assert out_bf16.dtype == jnp.bfloat16 and c.num_real_tokens < out_bf16.shape[0]
    np.testing.assert_array_equal(
        np.asarray(out_bf16).view(np.uint16), np.asarray(jnp.asarray(out_f32).astype(jnp.bfloat16)).view(np.uint16)
    )
    assert np.all(np.asarray(out_bf16[c.num_real_tokens :], np.float32) == 0)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("page_size", [8, 16])
def test_cpu_kernel_token_is_bitwise_independent_of_its_batch(dtype, page_size):
    """A token's output is bit-identical computed as a decode, as the last row of a
    prefill chunk, alone or beside other sequences (its row's arithmetic is its own), for
    every cache dtype (on AMX a bfloat16 decode's scores are computed transposed; 8-bit
    caches carry their scales)."""
    c = make_case([(1, 37)], 9, 3, 64, page_size=page_size)
    rng = np.random.RandomState(3)
    cache = np.where(np.isnan(c.kv_cache), rng.randn(*c.kv_cache.shape), c.kv_cache).astype(np.float32)
    if dtype == "bfloat16":
        cache = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(cache, jnp.bfloat16), jnp.uint16))
    elif dtype != "float32":
        cache = QuantizedKV(*quantize_rows(jnp.asarray(cache), dtype))
    pages = c.page_table[:1]
    q = rng.randn(40, 9, 64).astype(np.float32)

    def run(q, kv_lens, page_table, query_start_loc):
        args = (q, cache, np.int32(1), np.asarray(kv_lens, np.int32), page_table, np.asarray(query_start_loc, np.int32))
        return np.asarray(cpu.ragged_paged_attention(*args, 0, sm_scale=0.125))

    decode = run(q[:1], [37], pages, [0, 1])[0]
    q_chunk = q[:12].copy()  # positions 25..36: the last is the decode's, with its query
    q_chunk[11] = q[0]
    chunk = run(q_chunk, [37], pages, [0, 12])[11]
    beside = run(np.concatenate([q[20:25], q[:1]]), [30, 37], np.concatenate([pages, pages]), [0, 5, 6])[5]
    np.testing.assert_array_equal(decode, chunk)
    np.testing.assert_array_equal(decode, beside)


@needs_cpu_kernel
def test_without_amx_a_bfloat16_cache_keeps_its_bits_and_values():
    """Where this process reads a bfloat16 cache with AMX, a child with AMX off
    (JAXSERVE_CPU_AMX=0) reruns this file's bfloat16 CPU-kernel tests on the vector path
    that CPUs without AMX take: there a decode's values are widened where they lie
    (GroupValuesFromRows), a prefill chunk's through a buffer, and the token's bits must
    still agree."""
    if not cpu.uses_amx():
        pytest.skip("no AMX here: this process's bfloat16 tests ran the vector path")
    flags = ("-q", "-p", "no:xdist", "-p", "no:cacheprovider", __file__, "-k", "cpu_kernel and bfloat16")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXSERVE_CPU_AMX": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *flags], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


@needs_cpu_kernel
def test_cpu_kernel_rejects_bad_inputs_by_name():
    c = make_case([(1, 5)], 4, 2, 64, page_size=16)
    args = (c.kv_lens, c.page_table, c.query_start_loc)
    with pytest.raises(ValueError, match="float32, uint16"):
        cpu.ragged_paged_attention(c.q, c.kv_cache.astype(np.float16), 1, *args, sm_scale=1.0)
    with pytest.raises(ValueError, match="q has 3 heads"):
        cpu.ragged_paged_attention(c.q[:, :3], c.kv_cache, 1, *args, sm_scale=1.0)
    with pytest.raises(ValueError, match="must equal the cache's head_dim"):
        cpu.ragged_paged_attention(c.q[:, :, :32], c.kv_cache, 1, *args, sm_scale=1.0)
    # Metadata pointing outside the cache is an error, never an out-of-bounds read.
    bad_pages = np.where(c.page_table > 0, 10_000, 0).astype(np.int32)
    with pytest.raises(Exception, match="is not a page of the cache"):
        np.asarray(
            cpu.ragged_paged_attention(c.q, c.kv_cache, 1, c.kv_lens, bad_pages, c.query_start_loc, sm_scale=1.0)
        )
    with pytest.raises(Exception, match="q_len <= kv_len <= pages_per_seq"):
        np.asarray(
            cpu.ragged_paged_attention(
                c.q, c.kv_cache, 1, c.kv_lens * 100, c.page_table, c.query_start_loc, sm_scale=1.0
            )
        )
    with pytest.raises(Exception, match="layer 7 is not a layer"):
        np.asarray(cpu.ragged_paged_attention(c.q, c.kv_cache, 7, *args, sm_scale=1.0))


@needs_cpu_kernel
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_cpu_kernel_library_keeps_its_prefetches():
    """The attention kernel fetches scattered pages ahead of reading them. GCC deletes the
    calls to a function whose only effect is prefetching unless it is inlined first
    (JAXSERVE_PREFETCHER): the library once held no prefetch at all, and a 32-sequence
    decode's attention took 2.2x as long. And on x86 the float32-lane runner's prefetches
    go to the second-level cache (PREFETCHT1): into the first they stalled on its few miss
    buffers (a decode's attention ~1.4x as long on a Zen 4). Checked in the machine code of
    the library as built."""
    library = cpu_build.kernels().lib._name
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", library], capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    runners, prefetches, name = set(), set(), ""
    for line in listing.stdout.splitlines():
        if function := re.match(r"[0-9a-f]+ <(.*)>:$", line):
            name = function.group(1)
            if "TileRunner" in name:
                runners.add(name)
        elif "TileRunner" in name and (found := re.search(r"\t(prefetch\w*|prfm)\s", line)):
            prefetches.add(("amx" if "AmxTileRunner" in name else "lanes", found.group(1)))
    assert runners, "no TileRunner function in the library"
    assert prefetches, f"no prefetch instruction in {len(runners)} TileRunner functions"
    kinds = {kind for runner, kind in prefetches if runner == "lanes"}
    assert kinds in ({"prefetcht1"}, {"prfm"}), f"the float32-lane TileRunner prefetches with {sorted(kinds)}"


@needs_cpu_kernel
def test_cpu_kernel_fast_exp_is_bitwise_the_generic_one():
    """The softmax's exp in intrinsics gives the generic vector code's bits: with AVX-512
    its own floor and times-2^n (vrndscaleps, vscalefps) for the generic conversions and
    shifts, with AVX2 the same operations as the generic code on one 8-lane register. The
    same operations in the same order, so the same bits, for every 16th float32 in [-100,
    0] (the clamp at -87 included). The kernel's softmax thus gives the same probabilities
    on AVX-512 and AVX2 CPUs, as before the faster forms."""
    lib = cpu_build.kernels().lib
    lib.JaxserveExpMismatches.restype = ctypes.c_int64
    lib.JaxserveExpMismatches.argtypes = [ctypes.c_float, ctypes.c_uint32]
    mismatches = lib.JaxserveExpMismatches(-100.0, 16)
    if mismatches < 0:
        pytest.skip("neither AVX-512 nor AVX2 here: the generic exp is the only one")
    assert mismatches == 0, f"{mismatches} values' exp differ between the AVX-512 and the generic code"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tpu_write_kv_merges_whole_tiles(dtype):
    """The TPU write moves rows into whole memory tiles (8 float32 / 16 bfloat16 rows):
    a run starting mid-tile, scattered single slots (several per tile, with gaps), padding
    tokens sharing the scratch slot, and more tiles than one round of its buffer holds.
    Every page but the scratch page must equal the reference's exactly."""
    import ml_dtypes

    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    rng = np.random.RandomState(3)
    page_size, num_kv_heads, head_dim, num_pages = 16, 2, 64, 12
    cache = rng.randn(*tpu.get_kv_cache_shape(2, num_pages, page_size, num_kv_heads, head_dim)).astype(np_dtype)
    run = list(range(3 * page_size + 5, 3 * page_size + 5 + 23))  # crosses a page boundary mid-tile
    others = [s for s in range(page_size, num_pages * page_size) if s not in run]
    scattered = sorted(rng.choice(others, size=11, replace=False).tolist())
    slots = np.asarray(run + scattered[::-1] + [0] * 6, np.int32)  # unsorted singles, then padding
    k = rng.randn(len(slots), num_kv_heads, head_dim).astype(np_dtype)
    v = rng.randn(len(slots), num_kv_heads, head_dim).astype(np_dtype)
    tile_bytes = 2 * num_kv_heads * tpu.tile_rows(np_dtype) * cache.shape[-1] * np.dtype(np_dtype).itemsize
    expected = np.asarray(ref_write_kv(cache, np.int32(1), slots, k, v))
    got = np.asarray(
        tpu.write_kv(cache, np.int32(1), slots, k, v, interpret=not NATIVE, tile_buffer_bytes=2 * tile_bytes)
    )
    np.testing.assert_array_equal(got[:, :, 1:].astype(np.float32), expected[:, :, 1:].astype(np.float32))
    np.testing.assert_array_equal(got[:, 0].astype(np.float32), cache[:, 0].astype(np.float32))  # layer 0 untouched


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_tpu_write_kv_of_an_8bit_cache_sets_values_and_scales(dtype):
    """An 8-bit cache on TPU: the rows go in as whole 32-row tiles and each page's row of
    scales (128 lanes, its first page_size used) is rewritten whole with this step's lanes
    set, over several rounds of both kernels' buffers. Values and scales equal the
    reference's on every page but the scratch page; the padding lanes and layer 0 keep
    what they held."""
    rng = np.random.RandomState(4)
    page_size, num_kv_heads, head_dim, num_pages = 32, 2, 64, 16
    shape = tpu.get_kv_cache_shape(2, num_pages, page_size, num_kv_heads, head_dim)
    values, scales = quantize_rows(jnp.asarray(rng.randn(*shape).astype(np.float32)), dtype)
    lanes = rng.rand(*shape[:3], tpu.scale_lanes(page_size)).astype(np.float32)
    lanes[..., :page_size] = np.asarray(scales)
    cache = QuantizedKV(values, jnp.asarray(lanes))
    run = list(range(3 * page_size + 5, 3 * page_size + 5 + 40))  # crosses a page boundary mid-tile
    others = [s for s in range(page_size, num_pages * page_size) if s not in run]
    scattered = sorted(rng.choice(others, size=14, replace=False).tolist())
    slots = np.asarray(run + scattered[::-1] + [0] * 6, np.int32)  # unsorted singles, then padding
    k = rng.randn(len(slots), num_kv_heads, head_dim).astype(np.float32)
    v = rng.randn(len(slots), num_kv_heads, head_dim).astype(np.float32)
    as_reference = QuantizedKV(values, scales)
    expected = ref_write_kv(as_reference, np.int32(1), slots, k, v)
    tile_bytes = 2 * num_kv_heads * tpu.tile_rows(dtype) * shape[-1]
    got = tpu.write_kv(cache, np.int32(1), slots, k, v, interpret=not NATIVE, tile_buffer_bytes=2 * tile_bytes)
    assert len({s // page_size for s in slots}) > 8  # more page rows than one round of the scales kernel
    values_got, lanes_got = np.asarray(got.values).astype(np.float32), np.asarray(got.scales)
    np.testing.assert_array_equal(values_got[:, :, 1:], np.asarray(expected.values).astype(np.float32)[:, :, 1:])
    np.testing.assert_array_equal(lanes_got[:, :, 1:, :page_size], np.asarray(expected.scales)[:, :, 1:])
    np.testing.assert_array_equal(lanes_got[..., page_size:], lanes[..., page_size:])  # padding lanes
    np.testing.assert_array_equal(lanes_got[:, 0], lanes[:, 0])  # layer 0 untouched
    np.testing.assert_array_equal(values_got[:, 0], np.asarray(values).astype(np.float32)[:, 0])


def test_tpu_write_plan_counts_tiles_and_segments():
    """Slots 5..12 (rows 5-7 of tile 0 and 0-4 of tile 1 at 8 rows per tile), 20 and 22
    (tile 2 = page 1 rows 0-7, two segments: 21 is skipped), and two padding tokens on slot 0 (tile 0, a
    segment of its own before row 5)."""
    plan = tpu.plan_write(jnp.asarray([20, 5, 6, 7, 8, 9, 10, 11, 12, 22, 0, 0], jnp.int32), 16, 8)
    num_tiles, num_segs = (int(x) for x in plan.counts)
    assert (num_tiles, num_segs) == (3, 5)
    assert plan.tile_page[:3].tolist() == [0, 0, 1] and plan.tile_row[:3].tolist() == [0, 8, 0]
    assert plan.tile_first_seg[:4].tolist() == [0, 2, 3, 5]
    assert plan.seg_row[:5].tolist() == [0, 5, 0, 4, 6]
    assert plan.seg_len[:5].tolist() == [1, 3, 5, 1, 1]
    assert plan.seg_src[:5].tolist() == [0, 1, 4, 9, 10]
