"""The real SmolLM2-135M-Instruct GGUF against transformers loading the same file."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from jaxserve.models.checkpoint import open_checkpoint

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(
        str(smollm2_path), dtype="float32", max_num_batched_tokens=64, max_num_seqs=1, progress=False, warmup=False
    )


def test_every_dequantized_tensor_equals_transformers(smollm2_path, smollm2_hf):
    hf_model, _ = smollm2_hf
    ours = open_checkpoint(smollm2_path)
    reference = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    names = ours.tensor_names()
    assert len(names) == 272
    for name in names:
        got = ours.read(name)
        assert name in reference, name
        np.testing.assert_array_equal(got, reference[name], err_msg=name)


def test_gguf_index_reopens_the_same_checkpoint_without_parsing(smollm2_path, tmp_path, monkeypatch):
    """The second open of a GGUF file reads the index the first one wrote (config, tensor
    table, converted tokenizer): no gguf.GGUFReader, same tensors and tokens. A broken
    index is rebuilt, and a changed file gets a new one."""
    import gguf

    first = open_checkpoint(smollm2_path, tmp_path)
    (index,) = (tmp_path / "gguf").iterdir()

    def no_parse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf.GGUFReader, "__init__", no_parse)
    second = open_checkpoint(smollm2_path, tmp_path)
    assert second.config == first.config and second.tensor_names() == first.tensor_names()
    for name in ("model.embed_tokens.weight", "model.layers.3.self_attn.k_proj.weight", "model.norm.weight"):
        np.testing.assert_array_equal(second.read(name), first.read(name))
    text = "Hello <|im_start|>user\nWhat's 2+2? 日本語 😀<|im_end|>"
    assert second.tokenizer().encode(text) == first.tokenizer().encode(text)
    chat = [{"role": "user", "content": "Hi"}]
    assert second.tokenizer().apply_chat_template(chat, tokenize=False) == first.tokenizer().apply_chat_template(
        chat, tokenize=False
    )
    monkeypatch.undo()
    (index / "index.json").write_text("{not json")
    rebuilt = open_checkpoint(smollm2_path, tmp_path)
    assert rebuilt.config == first.config and json.loads((index / "index.json").read_text())["tensors"]
    (index / "tokenizer" / "tokenizer.json").write_text("{not json")  # found only when it loads
    assert open_checkpoint(smollm2_path, tmp_path).tokenizer().encode(text) == first.tokenizer().encode(text)
    assert open_checkpoint(smollm2_path, tmp_path).tokenizer().encode(text) == first.tokenizer().encode(text)
    assert json.loads((index / "tokenizer" / "tokenizer.json").read_text())  # rebuilt
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(smollm2_path, copy)
    open_checkpoint(copy, tmp_path)
    os.utime(copy, ns=(0, 0))  # the same path, another file as far as the index knows
    open_checkpoint(copy, tmp_path)
    assert len(list((tmp_path / "gguf").iterdir())) == 3


def test_tokenizer_and_chat_template_match_transformers(llm, smollm2_hf):
    _, hf_tok = smollm2_hf
    for text in PROMPTS + ["émoji 😀 and 日本語 text"]:
        messages = [{"role": "user", "content": text}]
        expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert llm.encode(messages) == hf_tok.encode(expected, add_special_tokens=False)
        assert llm.encode(text) == hf_tok.encode(text)


def test_greedy_chat_continuations_match_transformers(llm, smollm2_hf):
    hf_model, _ = smollm2_hf
    for prompt in PROMPTS:
        ids = llm.encode([{"role": "user", "content": prompt}])
        out = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0.0))[0]
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=2)
        assert out.token_ids == ref[0, len(ids) :].tolist(), prompt
    assert llm.stats()["kv_pages_held"] == 0


def test_capital_of_france_is_paris(llm):
    out = llm.generate(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=32, temperature=0.0)
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert (
        "".join(
            llm.stream(
                [{"role": "user", "content": "What is the capital of France?"}],
                SamplingParams(max_tokens=32, temperature=0.0),
            )
        )
        == out.text
    )


def test_batch_equivalence_on_smollm2(smollm2_path):
    """A CI-sized cut of the batch-equivalence workload on the real model (the full 48
    requests x 600 tokens run is `jaxserve bench offline` with an `alone:max_num_seqs=1`
    variant: equal output digests, see the README)."""
    import random

    llm = LLM(
        str(smollm2_path),
        dtype="float32",
        max_num_seqs=16,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        progress=False,
        warmup=False,
    )
    rng = random.Random(1)
    work = [
        ([rng.randrange(3, 49152) for _ in range(n)], SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
        for n, m in [(1, 24), (300, 1), (150, 16), (70, 20), (5, 12), (220, 8), (64, 24), (33, 6)]
    ]
    alone = [llm.generate([ids], p)[0].token_ids for ids, p in work]
    reqs = [llm.engine.add_request(ids, p) for ids, p in work]
    while llm.engine.has_unfinished():
        llm.engine.step()
        llm.scheduler.check_integrity()
    batched = [r.output_token_ids for r in reqs]
    assert batched == alone
    assert llm.stats()["kv_pages_free"] == llm.stats()["kv_pages_total"]


def test_prefix_caching_keeps_greedy_outputs_identical(smollm2_path):
    """Shared system prompt and multi-turn chat: caching off / page / token give the same tokens."""
    system = {
        "role": "system",
        "content": "You are a meticulous assistant for a geography quiz. Answer in one short sentence, "
        "name the country when relevant, and never add commentary beyond the answer itself.",
    }
    questions = ["What is the capital of France?", "What is the capital of Japan?", "Which ocean is the largest?"]
    turns = ["Name a river there.", "And a mountain?"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    results = {}
    for mode in ("off", "page", "token"):
        opts = {"enable_prefix_caching": False} if mode == "off" else {"prefix_match": mode}
        llm = LLM(str(smollm2_path), dtype="float32", max_num_batched_tokens=64, progress=False, warmup=False, **opts)
        shared = [
            o.token_ids for o in llm.generate([[system, {"role": "user", "content": q}] for q in questions], params)
        ]
        chats = [[system, {"role": "user", "content": q}] for q in questions[:2]]
        history = []
        for turn in [None, *turns]:
            if turn is not None:
                for chat in chats:
                    chat.append({"role": "user", "content": turn})
            outs = llm.generate(chats, params)
            history.append([o.token_ids for o in outs])
            for chat, o in zip(chats, outs, strict=True):
                chat.append({"role": "assistant", "content": o.text})
        results[mode] = (shared, history)
        if mode == "token":
            assert llm.stats()["prefix_cache_hit_tokens"] > 0
            llm.scheduler.check_integrity()
    assert results["page"] == results["off"]
    assert results["token"] == results["off"]


def test_server_stream_with_emoji_and_cjk_equals_offline(smollm2_path):
    """Over the real gRPC server: the streamed text (CJK + emoji) is exactly the offline text."""
    from jaxserve.client import Client
    from jaxserve.server.config import ServerConfig
    from jaxserve.server.server import Server, ServerHandle

    llm = LLM(
        str(smollm2_path), dtype="float32", max_num_batched_tokens=64, max_num_seqs=4, progress=False, warmup=False
    )
    prompts = [
        [{"role": "user", "content": "Write the Japanese word for cat (猫) and add a cat emoji 🐱."}],
        [{"role": "user", "content": 'Translate "hello" into Chinese characters and end with a smiley emoji 😊.'}],
    ]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    offline = [o.text for o in llm.generate(prompts, params)]
    assert any(ord(c) > 0x2E80 for c in offline[0]) and any(ord(c) > 0x1F000 for c in offline[1])
    handle = ServerHandle(
        Server(
            llm.handle, ServerConfig(port=0, http_port=None, metrics_port=None, warmup=False), "smollm2", progress=False
        )
    )
    addr = f"127.0.0.1:{handle.start()}"
    try:
        with Client(addr) as c:
            for prompt, want in zip(prompts, offline, strict=True):
                pieces = [m.text for m in c.stream(prompt, max_tokens=40, temperature=0.0)]
                assert "".join(pieces) == want
                assert not any("\ufffd" in p for p in pieces)
    finally:
        handle.stop()
