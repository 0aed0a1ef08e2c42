"""Compile once per machine: a second process loads every step program from the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jaxserve import compile_cache

# A fresh process (JAX keeps compiled programs in memory too): build and warm up an LLM
# over the cache folder given, generate once, report the counts and the tokens.
START = """
import json, sys
from jaxserve import LLM, SamplingParams
llm = LLM(sys.argv[1], cache_dir=sys.argv[2], progress=False, dtype="float32", num_pages=32,
          max_num_seqs=4, max_num_batched_tokens=32)
warm = llm.stats()
out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
after = llm.stats()
print(json.dumps({"compiles": warm["num_compiles"], "loaded": warm["num_compiles_loaded"],
                  "after_warmup": after["num_compiles"] - warm["num_compiles"], "tokens": out.token_ids}))
"""


def _start(model: str, cache_dir: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", START, model, cache_dir], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_every_program_instead_of_compiling(tiny_model_dir, tmp_path):
    path = str(tiny_model_dir("llama3")[0])
    first = _start(path, str(tmp_path))
    assert first["compiles"] > 0 and first["loaded"] == 0
    assert first["after_warmup"] == 0  # warmed up at construction: generate compiles nothing
    second = _start(path, str(tmp_path))
    assert second["loaded"] == second["compiles"] >= first["compiles"]  # nothing compiled
    assert second["after_warmup"] == 0
    assert second["tokens"] == first["tokens"]
    assert len(list((tmp_path / "xla").iterdir())) == 1  # one folder: this machine


def test_the_folder_depends_on_the_host_cpu(monkeypatch):
    class Device:
        platform, device_kind = "cpu", "cpu"

    here = compile_cache.machine_key([Device()])
    monkeypatch.setattr(compile_cache, "cpu_info", lambda: {"model name": "other", "flags": "avx2"})
    elsewhere = compile_cache.machine_key([Device()])
    assert here.startswith("cpu-") and elsewhere.startswith("cpu-") and here != elsewhere
