"""Tensor parallelism on simulated CPU devices: sharded greedy outputs and logits equal
one device's; each device holds 1/N of the KV heads and of the sharded weights; batch
equivalence and no compile after warm-up hold sharded.

JAX fixes its device count at start-up, so each scenario runs ``tests/sharded_check.py``
in a fresh process with 8 simulated devices.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.parallel import MeshConfig, check_divisible, make_mesh, replicate_kv_heads

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "sharded_check.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_sharded(r: dict, model_axis: int, kv_heads: int) -> None:
    assert r["devices"] == 8
    assert r["sharded"] == r["one"]
    # The row-parallel layers sum their shards' partial products in another order, and
    # XLA:CPU picks its dot kernels by the CPU: float32 rounding compounded over the
    # layers, a few 1e-6 of the largest logit (SmolLM2: up to 1.03e-4 on an AVX2 Zen 2,
    # under 1e-4 on AVX-512 CPUs). A wrong shard is off by whole units.
    assert r["max_logit_diff"] < 1e-5 * max(10.0, r["max_abs_logit"]), (r["max_logit_diff"], r["max_abs_logit"])
    # Every device holds 1/N of the KV heads of every page.
    assert r["kv_cache_spec"] == "P('model',)"
    assert r["kv_cache_devices"] == model_axis and r["num_kv_heads"] == kv_heads
    assert r["kv_shard_shapes"] == [[2 * kv_heads // model_axis, *r["kv_cache_shape"][1:]]]
    w = r["weights"]
    col = lambda name: [[*w[name]["shape"][:-1], w[name]["shape"][-1] // model_axis]]  # noqa: E731
    assert w["q_proj"]["shards"] == col("q_proj") and w["k_proj"]["shards"] == col("k_proj")
    for name in ("o_proj", "down_proj"):  # row-parallel
        L, n_in, n_out = w[name]["shape"]
        assert w[name]["shards"] == [[L, n_in // model_axis, n_out]]
    vocab, embed = w["embed"]["shape"]
    assert w["embed"]["shards"] == [[vocab // model_axis, embed]]


def test_tiny_eight_kv_heads_over_eight_devices():
    r = _run("tiny", "8", "8")
    _check_sharded(r, model_axis=8, kv_heads=8)
    assert r["batched_equals_alone"]
    assert r["compiles_after_warmup"] == 0
    assert r["kv_pages_free"] == r["kv_pages_total"]


def test_tiny_two_kv_heads_replicated_over_eight_devices():
    r = _run("tiny", "2", "8")
    _check_sharded(r, model_axis=8, kv_heads=8)  # each of the 2 heads held by 4 devices
    assert r["batched_equals_alone"]
    assert r["compiles_after_warmup"] == 0


def test_smollm2_over_three_devices(smollm2_path):
    r = _run("gguf", str(smollm2_path), "3")
    _check_sharded(r, model_axis=3, kv_heads=3)


def test_two_processes_on_localhost(tmp_path):
    """Multi-host on one machine: 2 processes x 2 CPU devices, mesh model 4 over both;
    process 0 schedules and serves, process 1 replays its steps and page copies."""
    sys.path.insert(0, str(ROOT / "tests"))
    from sharded_check import _tiny_model

    path = _tiny_model(8, str(tmp_path))  # pytest removes it; mkdtemp left one in /tmp per run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(ROOT / "tests" / "sharded_check.py"), "multihost", path, port]
    follower = subprocess.Popen([*cmd, "1"], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        leader = subprocess.run([*cmd, "0"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert leader.returncode == 0, leader.stderr[-3000:]
        assert follower.wait(timeout=60) == 0
    finally:
        follower.kill()
    r = json.loads(leader.stdout.strip().splitlines()[-1])
    assert (r["processes"], r["devices"], r["local_devices"], r["mesh_devices"]) == (2, 4, 2, 4)
    assert r["kv_local_shards"] == [[4, 2, 160, 8, 8]]  # 2 of 8 KV heads (K and V) per device
    assert r["sharded"] == r["one"]
    assert r["cached_tokens"] > 0


def test_replicated_kv_heads_keep_their_order():
    w = np.arange(2 * 3 * 4).reshape(2, 3 * 4)  # 3 KV heads of head_dim 4
    out = replicate_kv_heads(w, 3, 2)
    heads = out.reshape(2, 6, 4)
    for j in range(6):
        np.testing.assert_array_equal(heads[:, j], w.reshape(2, 3, 4)[:, j // 2])


def test_mesh_errors_name_the_field():
    with pytest.raises(ValueError, match="mesh.data = 2: must be 1"):
        MeshConfig.from_option({"data": 2, "model": 1})
    with pytest.raises(ValueError, match="keys data, model"):
        MeshConfig.from_option({"tensor": 2})
    with pytest.raises(ValueError, match="mesh.model = 0: must be an integer >= 1"):
        MeshConfig.from_option({"model": 0})
    with pytest.raises(ConfigError, match="mesh.model = 0"):
        EngineConfig.from_options(mesh={"model": 0})
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(MeshConfig(model=16))
    with pytest.raises(ValueError, match="must divide the model's 9 attention heads"):
        check_divisible(9, 3, 1536, 2)
    with pytest.raises(ValueError, match="divide the model's 3 KV heads or be a multiple"):
        check_divisible(12, 3, 1536, 4)
    assert check_divisible(8, 2, 96, 8) == 8 and check_divisible(9, 3, 1536, 3) == 3
