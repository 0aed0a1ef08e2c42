"""Compile once per machine: a second process loads every step program from the cache,
without tracing or lowering it (the program store, ``jaxserve/runner/programs.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxserve import compile_cache
from jaxserve.models import weight_cache
from jaxserve.runner import compile_counter, model_runner, programs

# A fresh process (JAX keeps compiled programs in memory too): build and warm up an LLM
# over the cache folder given, generate once, report the counts (programs compiled, loaded
# and lowered; checkpoint tensors read) and the tokens.
START = """
import json, sys, time
import jax
from jaxserve import LLM, SamplingParams
from jaxserve.models import checkpoint
lowered, reads, compiles = [], [], []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *a, **k: lowered.append(1) if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" else None)
jax.monitoring.register_event_duration_secs_listener(  # (start, end) of each XLA compile
    lambda event, s, *a, **k: compiles.append((time.monotonic() - s, time.monotonic()))
    if event == "/jax/core/compile/backend_compile_duration" else None)
real_read = checkpoint.HFCheckpoint.read
checkpoint.HFCheckpoint.read = lambda self, name: reads.append(name) or real_read(self, name)
llm = LLM(sys.argv[1], cache_dir=sys.argv[2], progress=False, dtype="float32", num_pages=32,
          max_num_seqs=4, max_num_batched_tokens=32, warmup_scoring=sys.argv[3] == "score")
warm = llm.stats()
out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
after = llm.stats()
print(json.dumps({"compiles": warm["num_compiles"], "loaded": warm["num_compiles_loaded"], "lowered": len(lowered), "reads": len(reads),
                  "after_warmup": after["num_compiles"] - warm["num_compiles"], "tokens": out.token_ids,
                  "samplers": sum(key[0] == "sample" for key in llm.runner._programs),
                  "at_once": max((sum(a <= t < b for a, b in compiles) for t, _ in compiles), default=0)}))
"""


def _start(model: str, cache_dir: str, warmup: str = "steps") -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", START, model, cache_dir, warmup], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_every_program_instead_of_compiling(tiny_model_dir, tmp_path):
    path = str(tiny_model_dir("llama3")[0])
    first = _start(path, str(tmp_path), "score")  # the prompt-scoring steps warmed too
    assert first["compiles"] > 0 and first["loaded"] == 0
    assert first["after_warmup"] == 0  # warmed up at construction: generate compiles nothing
    # Compiled several at a time on a CPU (ModelRunner._make), the same programs (below).
    assert first["at_once"] == min(os.cpu_count() or 1, model_runner.COMPILE_THREADS), first
    second = _start(path, str(tmp_path))  # which programs warm-up makes is no part of their keys
    assert second["loaded"] == second["compiles"] and 0 < second["compiles"] < first["compiles"]  # nothing compiled
    assert first["lowered"] >= first["compiles"] and second["lowered"] == 0  # nor traced and lowered
    assert first["reads"] > 0 and second["reads"] == 0  # the packed weights came from the cache
    assert second["after_warmup"] == 0
    assert second["tokens"] == first["tokens"]
    assert len(list((tmp_path / "xla").iterdir())) == 1  # one folder: this machine
    assert len(list((tmp_path / "xla").glob("*/programs/*/*.bin"))) == first["compiles"]
    assert len(list((tmp_path / "xla").glob("*/weights/*.bin"))) == 1
    # The sampler closes over no model: another model with the same vocabulary and sequence
    # buckets loads those programs (~0.7 s each to compile) and compiles its own forwards.
    other = _start(str(tiny_model_dir("qwen2")[0]), str(tmp_path))
    assert other["samplers"] > 0 and other["loaded"] == other["samplers"] < other["compiles"], other
    assert other["after_warmup"] == 0


def test_the_folder_depends_on_the_host_cpu(monkeypatch):
    class Device:
        platform, device_kind = "cpu", "cpu"

    here = compile_cache.machine_key([Device()])
    monkeypatch.setattr(compile_cache, "cpu_info", lambda: {"model name": "other", "flags": "avx2"})
    elsewhere = compile_cache.machine_key([Device()])
    assert here.startswith("cpu-") and elsewhere.startswith("cpu-") and here != elsewhere


def _f(x, y):
    return x * 2 + y, x.sum()


ARGS = (jnp.arange(8.0), np.ones(8, np.float32))


def test_the_store_loads_a_program_only_under_the_key_it_was_compiled_for(tmp_path):
    f = jax.jit(_f)
    first = programs.ProgramStore(tmp_path, b"runner a")
    compiled = first.compiled("f", f, ARGS)
    assert first.loaded == 0 and len(list(tmp_path.glob("*/*.bin"))) == 1
    again = programs.ProgramStore(tmp_path, b"runner a")
    loaded = again.compiled("f", f, ARGS)
    assert again.loaded == 1
    for a, b in zip(loaded(*ARGS), compiled(*ARGS), strict=True):
        np.testing.assert_array_equal(a, b)
    # Another runner, program name or argument type: each a program of its own.
    for context, name, args in (
        (b"runner b", "f", ARGS),
        (b"runner a", "g", ARGS),
        (b"runner a", "f", (jnp.arange(8), np.ones(8, np.int32))),
    ):
        store = programs.ProgramStore(tmp_path, context)
        store.compiled(name, f, args)
        assert store.loaded == 0
    assert len(list(tmp_path.glob("*/*.bin"))) == 4


def test_a_change_of_source_or_environment_is_another_key(tmp_path, monkeypatch):
    f = jax.jit(_f)
    programs.ProgramStore(tmp_path, b"r").compiled("f", f, ARGS)
    try:
        for change in (
            lambda: monkeypatch.setattr(programs.caching, "source_digest", lambda: "edited"),
            lambda: monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false"),
        ):
            monkeypatch.undo()
            change()
            programs.process_material.cache_clear()
            store = programs.ProgramStore(tmp_path, b"r")
            store.compiled("f", f, ARGS)
            assert store.loaded == 0
    finally:
        monkeypatch.undo()
        programs.process_material.cache_clear()


def test_other_codes_programs_go_least_recently_used_first_beyond_the_cap(tmp_path, monkeypatch):
    def folder(name: str, used: int) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "p.bin").write_bytes(b"x" * 1000)
        os.utime(tmp_path / name, (used, used))
        return tmp_path / name

    old, older, oldest, own = folder("b", 300), folder("c", 200), folder("a", 100), folder("own", 50)
    (tmp_path / "format1.bin").write_bytes(b"x")  # the one-folder layout's: nobody reads it now
    removed = programs.prune(tmp_path, keep=own, keep_bytes=2500)
    assert removed == [tmp_path / "format1.bin", oldest, older]  # 4000 bytes -> 2000
    assert old.exists() and own.exists()  # the open one stays, however old its use

    # A store that compiles prunes; one that only loads does not; opening one marks it used.
    f = jax.jit(_f)
    store = programs.ProgramStore(tmp_path, b"r")
    assert store.directory.stat().st_mtime > 300
    monkeypatch.setattr(programs, "KEEP_BYTES", 0)
    warm = programs.ProgramStore(tmp_path, b"r")
    store.compiled("f", f, ARGS)
    assert [p.name for p in tmp_path.iterdir()] == [store.directory.name]
    folder("d", 400)
    warm.compiled("f", f, ARGS)
    assert warm.loaded == 1 and (tmp_path / "d").exists()


def test_a_broken_file_is_compiled_again(tmp_path):
    f = jax.jit(_f)
    programs.ProgramStore(tmp_path, b"r").compiled("f", f, ARGS)
    (path,) = tmp_path.glob("*/*.bin")
    path.write_bytes(path.read_bytes()[:100])  # a write cut short
    store = programs.ProgramStore(tmp_path, b"r")
    out, total = store.compiled("f", f, ARGS)(*ARGS)
    assert store.loaded == 0 and float(total) == 28.0
    assert programs.ProgramStore(tmp_path, b"r").compiled("f", f, ARGS) is not None
    assert len(path.read_bytes()) > 100  # written again, whole


def test_a_program_that_jax_loaded_from_its_own_cache_is_not_kept(tmp_path, monkeypatch):
    # XLA:CPU serializes a loaded executable without its kernels (programs.py): only a
    # program XLA has just compiled may be written.
    loads = iter(range(100))
    monkeypatch.setattr(compile_counter, "num_cache_loads", lambda: next(loads))
    programs.ProgramStore(tmp_path, b"r").compiled("f", jax.jit(_f), ARGS)
    assert not list(tmp_path.glob("*/*.bin"))


def test_kept_weights_come_back_bit_for_bit_and_only_under_their_key(tmp_path):
    import ml_dtypes

    rng = np.random.default_rng(0)
    params = {
        "embed": rng.standard_normal((7, 5)).astype(np.float32),
        "layers": {
            "q_proj": rng.integers(0, 255, (3, 101), dtype=np.uint8),  # packed bytes, odd length
            "norm": rng.standard_normal((3, 9)).astype(ml_dtypes.bfloat16),
        },
        "lm_head": jnp.arange(12, dtype=jnp.int8).reshape(3, 4),
    }
    path = tmp_path / "w.bin"
    weight_cache.save(path, "key 1", params)
    back = weight_cache.load(path, "key 1")
    for (names, want), (names_back, got) in zip(
        traverse_util.flatten_dict(params).items(), traverse_util.flatten_dict(back).items(), strict=True
    ):
        assert names == names_back and got.dtype == want.dtype and isinstance(got, jax.Array)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert weight_cache.load(path, "key 2") is None  # another version of the code or file
    if Path("/proc/self/maps").exists():  # the parameters are the file's mapped pages, not a copy
        maps = [
            line.split()[0].split("-") for line in Path("/proc/self/maps").read_text().splitlines() if str(path) in line
        ]
        for got in traverse_util.flatten_dict(back).values():
            assert any(int(lo, 16) <= got.unsafe_buffer_pointer() < int(hi, 16) for lo, hi in maps), maps
    del back
    path.write_bytes(path.read_bytes()[:-100])  # a write cut short
    assert weight_cache.load(path, "key 1") is None


def test_a_checkpoint_keeps_one_file_per_load_options(tmp_path):
    ckpt = tmp_path / "model.gguf"
    ckpt.write_bytes(b"weights")
    graphdef = ("a model",)
    base, key, _ = weight_cache.entry(tmp_path / "w", ckpt, ("float32",), graphdef)
    other, _, _ = weight_cache.entry(tmp_path / "w", ckpt, ("bfloat16",), graphdef)
    assert other != base
    os.utime(ckpt, ns=(1, 1))  # the file changed: the same entry, another key
    again, changed, _ = weight_cache.entry(tmp_path / "w", ckpt, ("float32",), graphdef)
    assert again == base and changed != key
    assert weight_cache.entry(tmp_path / "w", ckpt, ("float32",), ("another model",)).key != changed


def test_a_save_removes_the_copies_of_checkpoints_that_are_gone_or_changed(tmp_path):
    folder, params = tmp_path / "w", {"w": np.ones((2, 3), np.float32)}

    def keep(e: weight_cache.Entry) -> None:
        weight_cache.save(e.path, e.key, params, e.files)

    ckpts = {name: tmp_path / name for name in ("kept.gguf", "deleted.gguf", "rewritten.gguf")}
    ckpts["folder"] = tmp_path / "hf"  # a checkpoint folder: every file in it is named
    ckpts["folder"].mkdir()
    for name in ("config.json", "model.safetensors"):
        (ckpts["folder"] / name).write_bytes(b"{}")
    entries = {}
    for name, ckpt in ckpts.items():
        if ckpt.suffix:
            ckpt.write_bytes(b"weights")
        entries[name] = weight_cache.entry(folder, ckpt, ("float32",), ("a model",))
        keep(entries[name])
    (folder / "not-ours.bin").write_bytes(b"something else")  # left alone
    assert len(list(folder.glob("*.bin"))) == len(entries) + 1

    ckpts["deleted.gguf"].unlink()
    ckpts["rewritten.gguf"].write_bytes(b"other weights")
    (ckpts["folder"] / "model.safetensors").unlink()
    assert weight_cache.prune(folder) == 3
    assert sorted(p.name for p in folder.glob("*.bin")) == sorted([entries["kept.gguf"].path.name, "not-ours.bin"])
    assert weight_cache.load(entries["kept.gguf"].path, entries["kept.gguf"].key) is not None

    # Each save prunes: a copy made from a temporary folder goes once the folder does.
    scratch = tmp_path / "scratch.gguf"
    scratch.write_bytes(b"weights")
    tmp = weight_cache.entry(folder, scratch, ("float32",), ("a model",))
    keep(tmp)
    scratch.unlink()
    keep(entries["kept.gguf"])
    assert not tmp.path.exists() and entries["kept.gguf"].path.exists()
    # A file an earlier jaxserve wrote names no checkpoint: its key has another source
    # digest, so it is either dead or rewritten at its next load.
    legacy = folder / "legacy.bin"
    weight_cache.save(legacy, "key", params)
    keep(entries["kept.gguf"])
    assert not legacy.exists()
