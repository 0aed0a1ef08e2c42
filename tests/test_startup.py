"""A start's warm-up runs on a thread of its own beside the tokenizer's load
(``ModelRunner.start_warmup``); a start that fails meanwhile stops it, so no thread is left
compiling after the error is reported."""

from __future__ import annotations

import shutil
import socket
import threading
from pathlib import Path

import pytest

from jaxserve import LLM, SamplingParams, cli
from jaxserve.errors import ModelLoadError
from jaxserve.runner import compile_counter

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "test-tiny.yaml"
OPTIONS = dict(dtype="float32", page_size=16, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64)


def _warmups() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "jaxserve-warmup"]


@pytest.fixture(autouse=True)
def _no_warmup_before():
    assert not _warmups(), "a warm-up of another test is still running"


def test_a_warm_start_waits_for_the_background_warmup_and_compiles_nothing_after(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama3")[0]), progress=False, **OPTIONS)
    assert not _warmups()  # construction waited for it
    warmed = compile_counter.num_compiles()
    pairs = llm.runner.cfg.bucket_pairs
    assert {("forward", *p) for p in pairs} <= set(llm.runner._programs)
    out = llm.generate([[5, 6, 7, 8], list(range(1, 60))], SamplingParams(max_tokens=8, temperature=0.0))
    assert all(len(o.token_ids) > 0 for o in out)
    assert compile_counter.num_compiles() == warmed


def test_a_tokenizer_that_fails_stops_the_warmup_it_overlapped(tiny_model_dir, tmp_path):
    """The tokenizer loads while the warm-up compiles (a fresh program store: every program
    is compiled, seconds of work): its error comes out with the warm-up already stopped."""
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for f in tiny_model_dir("llama3")[0].iterdir():
        if f.name == "config.json" or f.suffix == ".safetensors":
            shutil.copy(f, model / f.name)
    before = compile_counter.num_compiles()
    with pytest.raises(ModelLoadError, match="no tokenizer in"):
        LLM(str(model), cache_dir=str(tmp_path / "cache"), progress=False, **OPTIONS)
    assert not _warmups()
    assert compile_counter.num_compiles() - before < 4  # stopped at its next program, not run to the end


def test_a_server_that_cannot_bind_stops_the_warmup(tiny_model_dir, tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        before = compile_counter.num_compiles()
        argv = ["--cache-dir", str(tmp_path), "run", "--config", str(CONFIG), "--quiet"]
        argv += ["--set", f"model={tiny_model_dir('llama3')[0]}", "--set", f"server.port={port}"]
        assert cli.main(argv) == cli.EXIT_ERROR
    assert f"server.port = {port}" in capsys.readouterr().err
    assert not _warmups()
    assert compile_counter.num_compiles() - before < 4
