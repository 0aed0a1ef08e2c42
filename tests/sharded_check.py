"""Sharded-vs-one-device checks, run in a fresh process with simulated CPU devices.

JAX fixes the device count when it starts, so ``tests/test_sharding.py`` runs this file
as ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharded_check.py
SCENARIO [ARGS]`` and reads the JSON report it prints last. Scenarios:

- ``tiny KV_HEADS MODEL_AXIS``: a tiny Llama with 8 query heads;
- ``gguf PATH MODEL_AXIS``: a real checkpoint (SmolLM2);
- ``multihost PATH PORT PROCESS_ID``: two processes with 2 devices each (run both).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.runner.batch import ScheduledSeq  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10)


def _tiny_model(num_kv_heads: int, path: str) -> str:
    """A tiny Llama with 8 query heads saved in ``path``."""
    import torch
    import transformers as tf

    from tests.conftest import TINY, _tiny_tokenizer

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        **{**TINY, "num_attention_heads": 8, "num_key_value_heads": num_kv_heads}, tie_word_embeddings=False
    )
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    _tiny_tokenizer().save_pretrained(path)
    return path


def _llm(path: str, mesh, **kw) -> LLM:
    opts = dict(
        dtype="float32",
        page_size=8,
        num_pages=160,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
        progress=False,
        warmup=False,
    )
    return LLM(path, mesh=mesh, **{**opts, **kw})


def _prompt_logits(llm: LLM, ids: list[int]) -> np.ndarray:
    pages = llm.kv.pool.allocate(llm.kv.pool.pages_needed(len(ids)))
    try:
        return llm.runner.logits([ScheduledSeq(ids, 0, pages)])
    finally:
        llm.kv.pool.release(pages)


def _logit_diff(one: np.ndarray, sharded: np.ndarray) -> dict:
    return {"max_logit_diff": float(np.abs(one - sharded).max()), "max_abs_logit": float(np.abs(one).max())}


def _shard_shapes(x: jax.Array) -> list[list[int]]:
    return sorted({tuple(s.data.shape) for s in x.addressable_shards})


def compare(path: str, model_axis: int, vocab: int, extra_checks: bool) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (45, 3, 70, 17)]
    one = _llm(path, None)
    sharded = _llm(path, {"model": model_axis})
    report = {
        "devices": len(jax.devices()),
        "one": [o.token_ids for o in one.generate(prompts, GREEDY)],
        "sharded": [o.token_ids for o in sharded.generate(prompts, GREEDY)],
        **_logit_diff(_prompt_logits(one, prompts[0][:32]), _prompt_logits(sharded, prompts[0][:32])),
        "kv_cache_shape": list(sharded.runner.kv_cache.shape),
        "kv_cache_spec": str(sharded.runner.kv_cache.sharding.spec),
        "kv_shard_shapes": _shard_shapes(sharded.runner.kv_cache),
        "kv_cache_devices": len(sharded.runner.kv_cache.sharding.device_set),
        "num_kv_heads": sharded.runner.kv_cache.shape[0] // 2,
        "weights": {
            name: {"shape": list(w.shape), "shards": _shard_shapes(w)}
            for name, w in (
                ("q_proj", sharded.runner.state["layers"]["q_proj"][...]),
                ("k_proj", sharded.runner.state["layers"]["k_proj"][...]),
                ("o_proj", sharded.runner.state["layers"]["o_proj"][...]),
                ("down_proj", sharded.runner.state["layers"]["down_proj"][...]),
                ("embed", sharded.runner.state["embed"][...]),
            )
        },
    }
    if extra_checks:
        # Batch equivalence and no compile after warm-up, sharded.
        sharded.runner.warmup(progress=False)
        compiles = sharded.stats()["num_compiles"]
        work = [([rng.randrange(vocab) for _ in range(n)], m) for n, m in ((90, 5), (1, 12), (33, 9), (60, 3), (7, 7))]
        alone = [
            sharded.generate([ids], SamplingParams(**{**GREEDY_KW, "max_tokens": m}))[0].token_ids for ids, m in work
        ]
        reqs = [sharded.engine.add_request(ids, SamplingParams(**{**GREEDY_KW, "max_tokens": m})) for ids, m in work]
        while sharded.engine.has_unfinished():
            sharded.engine.step()
            sharded.scheduler.check_integrity()
        report["batched_equals_alone"] = [r.output_token_ids for r in reqs] == alone
        report["compiles_after_warmup"] = sharded.stats()["num_compiles"] - compiles
        stats = sharded.stats()
        report["kv_pages_free"], report["kv_pages_total"] = stats["kv_pages_free"], stats["kv_pages_total"]
    return report


GREEDY_KW = dict(temperature=0.0, ignore_eos=True)


def multihost(path: str, port: str, process_id: int) -> dict | None:
    """Two processes x 2 devices, mesh model 4: process 0 serves, process 1 follows."""
    rng = random.Random(0)
    prompts = [[rng.randrange(320) for _ in range(n)] for n in (45, 3, 70, 17)]
    dist = {"coordinator_address": f"127.0.0.1:{port}", "num_processes": 2, "process_id": process_id}
    sharded = _llm(path, {"model": 4}, distributed=dist, enable_prefix_caching=True)
    sharded.runner.compile_ahead(progress=False)  # each process on its own: no collective inside
    if process_id != 0:
        sharded.runner.follow()
        return None
    shared = prompts[2][:43]  # a shared prefix ending mid-page: the prefix cache's page copies are replayed too
    work = prompts + [shared + [5, 6, 7], shared + [9]]
    one = _llm(path, None, enable_prefix_caching=True)  # process 0's first device alone
    report = {
        "processes": jax.process_count(),
        "devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "mesh_devices": len(sharded.runner.kv_cache.sharding.device_set),
        "kv_local_shards": _shard_shapes(sharded.runner.kv_cache),
        "one": [o.token_ids for o in one.generate(work, GREEDY)],
        "sharded": [o.token_ids for o in sharded.generate(work, GREEDY)],
        "cached_tokens": sharded.stats()["prefix_cache_hit_tokens"],
    }
    sharded.runner.stop_followers()
    return report


def main() -> None:
    scenario = sys.argv[1]
    if scenario == "multihost":
        report = multihost(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        if report is None:
            return
    elif scenario == "tiny":
        num_kv_heads, model_axis = int(sys.argv[2]), int(sys.argv[3])
        with tempfile.TemporaryDirectory(prefix=f"tiny-kv{num_kv_heads}-") as path:  # not left in /tmp
            report = compare(_tiny_model(num_kv_heads, path), model_axis, 320, extra_checks=True)
    elif scenario == "gguf":
        report = compare(sys.argv[2], int(sys.argv[3]), 49152, extra_checks=False)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}: tiny | gguf")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
