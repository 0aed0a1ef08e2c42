"""The oneDNN matmul (``pallas_kernels.cpu_matmul``): values against XLA's dot (and the
SwiGLU call's against XLA's silu of the two products), a row independent of the rows
beside it, and bad inputs refused by name."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.plan import resolve_matmul
from pallas_kernels import cpu_build, cpu_matmul

pytestmark = pytest.mark.skipif(not cpu_matmul.available("float32"), reason="oneDNN matmul unavailable here")
# bfloat16 weights need AVX-512 for oneDNN 3.2, or the kernel's own loop (AVX2: cpu_panels.h).
BF16 = pytest.param(
    ml_dtypes.bfloat16,
    marks=pytest.mark.skipif(not cpu_matmul.available("bfloat16"), reason="no oneDNN bfloat16 matmul on this CPU"),
)

# SmolLM2's layer shapes (fused q|k|v, o, gate|up, down), a tiny test model's, and its head.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (64, 96), (96, 64), (576, 49152)]
# Past 256 rows oneDNN's plain GEMM (float32 without AVX-512) would change kernels; the
# matmul runs such calls as row blocks of <= 256 (cpu_matmul.cc).
ROWS = (8, 9, 16, 32, 64, 100, 300, 512)


def _weight(k: int, n: int, dtype, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((k, n)) * 0.05).astype(dtype)


@pytest.mark.parametrize("dtype", [BF16, np.float32])
@pytest.mark.parametrize("k, n", SHAPES[:4])
def test_matches_xla_dot(k, n, dtype):
    w = _weight(k, n, dtype)
    packed = jnp.asarray(np.stack([_weight(k, n, dtype, seed=9), w]).astype(dtype))  # layer 1 is w
    stack = jnp.asarray(np.stack([cpu_matmul.pack(np.asarray(x)) for x in packed]))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((24, k)), jnp.float32)
    got = np.asarray(cpu_matmul.matmul(x, stack, 1, n, dtype))
    want = np.asarray(jnp.dot(x.astype(dtype), jnp.asarray(w), preferred_element_type=jnp.float32))
    assert got.shape == (24, n) and got.dtype == np.float32
    tol = 1e-2 if dtype is ml_dtypes.bfloat16 else 1e-4  # accumulation order differs
    np.testing.assert_allclose(got, want, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("dtype", [BF16, np.float32])
@pytest.mark.parametrize("k, n", SHAPES)
def test_a_row_does_not_depend_on_the_rows_beside_it(k, n, dtype):
    """The same input row inside calls of 8 to 512 rows gives the same bits: the packed
    layout fixes the order of every sum (the head pads to 8 rows; see llama.py), and on
    oneDNN's plain GEMM the row blocks keep it on one kernel."""
    stack = jnp.asarray(cpu_matmul.pack(_weight(k, n, dtype))[None])
    rng = np.random.default_rng(2)
    row = rng.standard_normal(k).astype(np.float32)
    # The packed weight is an argument: closed over, its bytes would be a constant that
    # XLA folds into every compile (3 s each for the head's 113 MB).
    f = jax.jit(lambda x, packed: cpu_matmul.matmul(x, packed, 0, n, dtype))
    outs = []
    for m in ROWS:
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[m // 2] = row
        outs.append(np.asarray(f(jnp.asarray(x), stack))[m // 2])
    for other in outs[1:]:
        np.testing.assert_array_equal(outs[0], other)


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_a_calls_padding_rows_are_skipped_and_come_out_zero(dtype):
    """With ``rows`` (the step's tokens lead a token bucket's rows), matmul and swiglu
    compute the first ``rows`` rounded up to 8 (32 on oneDNN's plain GEMM, none on the
    kernel's own loop without AVX-512), or fewer than 8 alone where oneDNN gives
    them its 8-row call's bits (rows_computed), and write zeros below: the rows in use are
    bitwise those of the whole call, and a 300-token step in the 512-row bucket computes 304
    rows (320 on oneDNN's plain GEMM, 300 on the kernel's own loop), not 512."""
    k, n, i = 576, 576, 1536
    stack = jnp.asarray(cpu_matmul.pack(_weight(k, n, dtype))[None])
    mlp = jnp.asarray(cpu_matmul.pack_swiglu(_weight(k, i, dtype, 3), _weight(k, i, dtype, 4))[None])
    x = jnp.asarray(np.random.default_rng(5).standard_normal((512, k)).astype(np.float32))
    mm = jax.jit(lambda x, w, rows: cpu_matmul.matmul(x, w, 0, n, dtype, rows))
    sw = jax.jit(lambda x, w, rows: cpu_matmul.swiglu(x, w, 0, i, dtype, rows))
    impl = cpu_matmul.impl(256, k, n, dtype)
    quantum = 32 if impl.startswith("gemm") else 1 if impl.startswith("jaxserve:panels") else 8
    for f, w, width in ((mm, stack, n), (sw, mlp, 2 * i)):
        whole = np.asarray(f(x, w, 512), np.float32)
        assert whole.any(axis=1).all()  # so zeros in a call with rows are rows it skipped
        for rows in (300, 320, 33, 8, 7, 5, 3, 2, 1, 0):  # 0: a step of no new tokens (1 row, or 8)
            used = cpu_matmul.rows_computed(rows, 512, k, width, dtype)
            rounded = min(512, -(-max(rows, 1) // quantum) * quantum)
            alone = max(rows, 1) if rows < 8 else rounded  # where oneDNN agrees (FewRowsAgree)
            assert used in (rounded, alone)
            part = np.asarray(f(x, w, rows), np.float32)
            np.testing.assert_array_equal(part[:used], whole[:used])
            assert not part[used:].any(), (rows, used)
        np.testing.assert_array_equal(np.asarray(f(x, w, 600), np.float32), whole)  # out of range: all rows


@pytest.mark.skipif(
    not cpu_matmul.available("bfloat16")
    or not cpu_matmul.impl(32, 576, 576, ml_dtypes.bfloat16).startswith("brg:avx512_core_amx")
    or os.environ.get("JAXSERVE_CPU_AMX") == "0",
    reason="oneDNN runs bfloat16 without AMX here",
)
def test_a_decodes_few_rows_run_on_the_kernels_own_tiles():
    """Up to 32 rows of bfloat16 run the kernel's own AMX loop (faster at streaming the
    weight), which it uses only where it gave oneDNN's bits for the shape when the call was
    first built; test_a_row_does_not_depend_on_the_rows_beside_it then holds those rows to
    the same rows in 64-512-row calls, which oneDNN runs. Every shape above takes it."""
    for k, n in SHAPES:
        assert [cpu_matmul.uses_tiles(m, k, n) for m in (8, 9, 32, 64)] == [True, True, True, False], (k, n)


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_a_shapes_later_calls_ask_onednn_nothing(dtype):
    """A call's layout questions (a matmul descriptor built each, ~10 us: a third of a small
    decode call when every call asked) are answered once per shape: later calls of the
    matmul and SwiGLU kernels, decode- and prefill-sized, ask none."""
    k, n = 96, 64
    packed = jnp.asarray(cpu_matmul.pack(_weight(k, n, dtype))[None])
    gate_up = jnp.asarray(cpu_matmul.pack_swiglu(_weight(k, n, dtype), _weight(k, n, dtype, seed=1))[None])
    calls = jax.jit(
        lambda x: (cpu_matmul.matmul(x, packed, 0, n, dtype), cpu_matmul.swiglu(x, gate_up, 0, n, dtype)),
    )
    xs = [jnp.asarray(np.ones((m, k), dtype)) for m in (8, 32, 512)]
    for x in xs:
        jax.block_until_ready(calls(x))
    asked = cpu_matmul.layout_queries()
    for x in xs * 3:
        jax.block_until_ready(calls(x))
    assert cpu_matmul.layout_queries() == asked


@pytest.mark.skipif(cpu_build.threads() < 2, reason="one core: no helper threads")
def test_a_helper_lingers_for_the_next_calls_work():
    """A helper that has run out of a call's items waits for the next call's work
    (cpu_threads.h) instead of sleeping in XLA's pool, and that call schedules no task of
    its own. Checked by the library on its own threads, by who ran which item, not by
    time (JaxserveLingerCheck)."""
    assert cpu_matmul.linger_check() == 0


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_the_bit_checks_run_on_varied_operands(dtype):
    """The kernel picks a way to compute a shape (its own AMX loop, parts of a slice) only
    where it gave oneDNN's bits on pseudo-random operands: varied ones, since operands of few
    values (zeros, say) agree whatever order a kernel sums in. Filled in place where the
    packed layout has no padding (the LM head's and the MLP's slices) and through a pack where
    it has (a [64, 40] weight in blocks of 64 columns)."""
    assert cpu_matmul.check_operand_values(8, 576, 24576, dtype) > 3000
    assert cpu_matmul.check_operand_values(32, 576, 1536, dtype) > 2000
    assert cpu_matmul.check_operand_values(8, 64, 40, dtype) > 500


@pytest.mark.parametrize("dtype", [BF16, np.float32])
@pytest.mark.parametrize("k, i", [(576, 1536), (64, 40)])  # SmolLM2's MLP; slices of 20: a partial group of 16
def test_swiglu_matches_silu_of_the_two_products(k, i, dtype):
    """One call gives silu(x @ gate) * (x @ up) in the weights' dtype (what the next matmul
    reads): against the same two products by XLA and jax.nn.silu, and for each row of a
    call of 8 to 1100 rows the same bits as in any other (calls of 512+ rows run parts of
    each slice's columns, past 512 also blocks of rows: cpu_matmul.cc)."""
    gate, up = _weight(k, i, dtype, seed=3), _weight(k, i, dtype, seed=4)
    stack = jnp.asarray(np.stack([cpu_matmul.pack_swiglu(_weight(k, i, dtype, 5), _weight(k, i, dtype, 6)),
                                  cpu_matmul.pack_swiglu(gate, up)]))  # fmt: skip
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((24, k)), jnp.float32)
    got = cpu_matmul.swiglu(x, stack, 1, i, dtype)
    assert got.shape == (24, i) and got.dtype == jnp.dtype(dtype)
    dot = functools.partial(jnp.dot, x.astype(dtype), preferred_element_type=jnp.float32)
    want = jax.nn.silu(dot(jnp.asarray(gate))) * dot(jnp.asarray(up))
    tol = 2e-2 if dtype is ml_dtypes.bfloat16 else 1e-4  # accumulation order, bfloat16 rounding
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=tol * np.abs(want).max())

    f = jax.jit(lambda x, packed: cpu_matmul.swiglu(x, packed, 1, i, dtype))
    row = rng.standard_normal(k).astype(np.float32)
    outs = []
    for m in (8, 24, 512, 1100):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[m - 3] = row  # in the last block of rows
        outs.append(np.asarray(f(jnp.asarray(x), stack), np.float32)[m - 3])
    for other in outs[1:]:
        np.testing.assert_array_equal(outs[0], other)


def _child(env: dict[str, str], *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """This Python run with ``args`` in a child process, ``env`` added to the environment
    (on the CPU): what oneDNN picks is fixed per process (ONEDNN_MAX_CPU_ISA, AMX's use)."""
    return subprocess.run(
        [sys.executable, *args],
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _rerun(env: dict[str, str], tests: str) -> None:
    """Reruns this file's tests matching ``tests`` (pytest -k) in a child process with
    ``env`` added to the environment, and asserts they passed."""
    flags = ("-q", "-p", "no:xdist", "-p", "no:cacheprovider", __file__, "-k", tests)
    proc = _child(env, "-m", "pytest", *flags, timeout=600)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("panels", [True, False], ids=["own-loop", "onednn-gemm"])
def test_without_avx512_float32_runs_the_kernels_own_loop(panels):
    """Without AVX-512, float32 weights run on the kernel's own loop (cpu_panels.h: every
    row its own at any row count); checked on any CPU, in a child process capped at AVX2
    (ONEDNN_MAX_CPU_ISA) where this one has AVX-512, that reruns this file's
    row-independence and padding-rows tests on it. JAXSERVE_CPU_PANELS=0 keeps oneDNN's
    plain GEMM instead, to compare against: its values are checked, not its rows'
    independence (on a 2-core Zen 3 a 32-row call's rows differed in their last bits from
    the same rows of a 512-row call)."""
    native = cpu_matmul.impl(512, 576, 3072, np.float32).startswith(("gemm", "jaxserve:panels"))
    env = {} if native else {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    if not panels:
        env["JAXSERVE_CPU_PANELS"] = "0"
    if not env:
        pytest.skip("the kernel's own loop is this CPU's path: the tests above ran on it")
    probe = "from pallas_kernels import cpu_matmul; print(cpu_matmul.impl(512, 576, 3072, 'float32'))"
    impl = _child(env, "-c", probe)
    assert impl.stdout.strip().startswith("jaxserve:panels" if panels else "gemm"), impl.stdout + impl.stderr[-2000:]
    _rerun(env, "a_row or swiglu or padding_rows" if panels else "matches_xla_dot")


def test_without_amx_a_decodes_few_rows_run_alone():
    """Where oneDNN runs bfloat16 on AVX-512 BF16 (no AMX), fewer than 8 rows in use run
    alone (a lone decode: 1 row where the call would compute 8) if oneDNN gives them its
    8-row call's bits (cpu_matmul.cc: FewRowsAgree); the padding-rows test holds whatever
    rows_computed claims to those bits. On an AMX CPU, a child with AMX off
    (JAXSERVE_CPU_AMX=0, oneDNN capped at AVX512_CORE_BF16) must run 1 to 7 rows alone
    (oneDNN 3.2 agreed for every shape there) and pass the padding-rows test."""
    if not cpu_matmul.available("bfloat16") or not cpu_matmul.impl(32, 576, 576, ml_dtypes.bfloat16).startswith(
        "brg:avx512_core_amx"
    ):
        pytest.skip("no AMX here: the padding-rows test ran this CPU's own path")
    env = {"JAXSERVE_CPU_AMX": "0", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    probe = (
        "from pallas_kernels import cpu_matmul\n"
        "print([cpu_matmul.rows_computed(u, 512, k, n, 'bfloat16') for u in (1, 7) for k, n in"
        " ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))])"
    )
    child = _child(env, "-c", probe)
    assert child.stdout.strip() == str([1] * 5 + [7] * 5), child.stdout + child.stderr[-2000:]
    _rerun(env, "padding_rows and bfloat16")


def test_bad_inputs_are_refused_by_name():
    w = _weight(64, 96, np.float32)
    stack = jnp.asarray(cpu_matmul.pack(w)[None])
    x = jnp.ones((8, 64), jnp.float32)
    with pytest.raises(ValueError, match="packed weights are one of float32, bfloat16, not float16"):
        cpu_matmul.pack(w.astype(np.float16))
    with pytest.raises(ValueError, match=r"\[K, N\]"):
        cpu_matmul.pack(np.ones((2, 3, 4), np.float32))
    with pytest.raises(Exception, match="bytes per layer"):  # a weight packed for another shape
        np.asarray(cpu_matmul.matmul(x, stack, 0, 960, "float32"))
    with pytest.raises(Exception, match="layer 3 is not in packed"):
        np.asarray(cpu_matmul.matmul(x, stack, 3, 96, "float32"))


def test_matmul_backend_option():
    """onednn where it cannot run is one error naming the option; auto falls back."""
    assert resolve_matmul("xla", "bfloat16", "cpu", sharded=False) == "xla"
    assert resolve_matmul("onednn", "float32", "cpu", sharded=False) == "onednn"
    assert resolve_matmul("auto", "float32", "cpu", sharded=False) == "onednn"
    if cpu_matmul.available("bfloat16"):
        assert resolve_matmul("onednn", "bfloat16", "cpu", sharded=False) == "onednn"
        if cpu_matmul.own_loop("bfloat16"):  # without AVX-512: fast without bfloat16 units
            assert resolve_matmul("auto", "bfloat16", "cpu", sharded=False) == "onednn"
    else:  # JAXSERVE_CPU_PANELS=0 on an AVX2 CPU: bfloat16 weights go to XLA's dots, or are one error naming why
        assert resolve_matmul("auto", "bfloat16", "cpu", sharded=False) == "xla"
        with pytest.raises(ConfigError, match="matmul_backend 'onednn': oneDNN has no fast bfloat16 matmul"):
            resolve_matmul("onednn", "bfloat16", "cpu", sharded=False)
    assert resolve_matmul("auto", "float16", "cpu", sharded=False) == "xla"
    assert resolve_matmul("auto", "bfloat16", "cpu", sharded=True) == "xla"
    for args, why in (
        (("bfloat16", "tpu"), "it runs on the CPU only"),
        (("float16", "cpu"), "weight_dtype 'float16' is not one of float32, bfloat16"),
    ):
        with pytest.raises(ConfigError, match=f"matmul_backend 'onednn': {why}"):
            resolve_matmul("onednn", *args, sharded=False)
    with pytest.raises(ConfigError, match="one CPU device, not a mesh"):
        resolve_matmul("onednn", "float32", "cpu", sharded=True)
    with pytest.raises(ConfigError, match="matmul_backend"):
        EngineConfig(matmul_backend="mkl")


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_a_prefills_swiglu_runs_parts_of_slices_and_a_decodes_whole_ones(dtype):
    """A 512-row call's gate|up products (3 MB a slice) would be read back from memory: its work
    items take parts of a slice, which oneDNN computes bitwise as the whole (checked when the
    call is planned); a decode's 32 rows run whole slices. (AMX and AVX-512 BF16 pack in
    blocks of columns, the kernel's own loop without AVX-512 in panels of 16;
    oneDNN's plain layouts cannot be split, and run whole slices.)"""
    width = 1536 // cpu_matmul.swiglu_slices(1536, dtype)
    assert cpu_matmul.swiglu_part(32, 576, 1536, dtype) == width
    assert cpu_matmul.swiglu_part(8, 64, 40, dtype) == 40 // cpu_matmul.swiglu_slices(40, dtype)
    part = cpu_matmul.swiglu_part(512, 576, 1536, dtype)
    if not cpu_matmul.impl(512, 576, 3072, dtype).startswith(("brg", "jaxserve:panels")):
        pytest.skip(f"oneDNN runs {cpu_matmul.impl(512, 576, 3072, dtype)} here: whole slices (part {part})")
    assert part < width and width % part == 0, part


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_add_rms_norm_is_the_models_norm_of_the_sum(dtype):
    """add_rms_norm is x + y (the slices joined) bit for bit, and llama.rms_norm of it to
    float32 rounding (its sum of squares runs in another order than XLA's), in the weights'
    dtype within one bfloat16 rounding; a row's bits do not depend on the rows beside it."""
    from jaxserve.models.llama import rms_norm

    rng = np.random.default_rng(0)
    m, e = 40, 576
    x = jnp.asarray(rng.standard_normal((m, e)).astype(np.float32) * 3)
    y = jnp.asarray(rng.standard_normal((2, m, e // 2)).astype(np.float32))
    w = jnp.asarray(rng.uniform(0.5, 1.5, e).astype(np.float32))
    total, h = jax.jit(cpu_matmul.add_rms_norm, static_argnums=(3, 4))(x, y, w, 1e-5, dtype)
    joined = x + cpu_matmul.join_slices(y)
    np.testing.assert_array_equal(total, joined)
    want = rms_norm(joined, w, 1e-5)
    assert h.dtype == jnp.dtype(dtype)
    np.testing.assert_allclose(np.asarray(h, np.float32), want, rtol=1e-6 if dtype == "float32" else 8e-3, atol=1e-6)
    alone = cpu_matmul.rms_norm(joined, w, 1e-5, dtype)
    np.testing.assert_array_equal(np.asarray(alone, np.float32), np.asarray(h, np.float32))
    few = cpu_matmul.rms_norm(joined[5:13], w, 1e-5, dtype)
    np.testing.assert_array_equal(np.asarray(few, np.float32), np.asarray(h, np.float32)[5:13])
