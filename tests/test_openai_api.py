"""The OpenAI-compatible HTTP API, end to end: a real server (gRPC + HTTP on free loopback
ports, one engine) called with the official ``openai`` client, sync, async and streaming."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import re

import grpc
import httpx
import openai
import pytest

from jaxserve import SamplingParams
from jaxserve.client import Client, wait_until_serving
from jaxserve.errors import RequestError
from jaxserve.server.config import ServerConfig
from jaxserve.server.server import SERVICE_NAME
from tests.conftest import engine_held, gated_server, rng_tokens, wait_until

GREEDY = dict(temperature=0.0)
NO_EOS = {"ignore_eos": True}  # vLLM's extra, through extra_body
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The capital of France?"}]
PET_SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["kind", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def api(tiny_model_dir):
    path, _ = tiny_model_dir("llama3")
    cfg = ServerConfig(port=0, http_port=0, metrics_port=None, max_waiting_requests=64)
    with gated_server(path, cfg) as (llm, server, port, open_gate):
        wait_until(lambda: server.http_port is not None, "the HTTP API's port")
        base = f"http://127.0.0.1:{server.http_port}"
        warming = (
            httpx.get(f"{base}/health"),
            httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}),
        )
        open_gate()
        wait_until_serving(f"127.0.0.1:{port}", timeout=300, service=SERVICE_NAME)
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client:
            yield llm, server, f"127.0.0.1:{port}", base, client, warming


def test_warming_up_is_503_then_health_and_models(api):
    llm, server, _, base, client, (health, completion) = api
    assert health.status_code == 503
    assert completion.status_code == 503 and "warming up" in completion.json()["error"]["message"]
    assert httpx.get(f"{base}/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"  # was FastAPI's own 404
    with pytest.raises(openai.NotFoundError, match="model = 'other': this server serves 'tiny'"):
        client.models.retrieve("other")


def test_metrics_and_version_on_the_api_port_as_vllms(api):
    """vLLM serves /metrics and /version on its API port; a scraper set up for it reads the
    same Prometheus text here (server.metrics_port is off in this server)."""
    llm, server, _, base, client, _ = api
    client.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body=NO_EOS, **GREEDY)
    got = httpx.get(f"{base}/metrics")
    assert got.status_code == 200 and got.headers["content-type"].startswith("text/plain")
    assert re.search(r"^jaxserve_generation_tokens_total [1-9]", got.text, re.M), got.text[:500]
    assert f"jaxserve_kv_pages_total {llm.stats()['kv_pages_total']}.0" in got.text
    assert httpx.get(f"{base}/version").json() == {"version": importlib.metadata.version("jaxserve")}


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(api):
    """vLLM's truncate_prompt_tokens: only the prompt's last k tokens are computed (-1: as
    many as the context holds), so a prompt longer than the context is answered; a chat's
    rendering is cut the same way; echo gives the text computed. Bad k: one 400 naming it."""
    llm, server, _, base, client, _ = api
    room = llm.handle.max_model_len - 1
    long = rng_tokens(room + 40, 320, seed=5)

    def complete(prompt, max_tokens=4, echo=False, **extra):
        return client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, echo=echo, extra_body={**NO_EOS, **extra}, **GREEDY
        )

    got = complete(long, truncate_prompt_tokens=50)
    assert got.usage.prompt_tokens == 50 and got.choices[0].text == complete(long[-50:]).choices[0].text
    with pytest.raises(openai.BadRequestError, match="must be shorter than max_model_len"):
        complete(long)
    assert complete(long, max_tokens=1, truncate_prompt_tokens=-1).usage.prompt_tokens == room
    text = "one two three four five six"
    ids = llm.handle.encode(text)
    echoed = complete(text, echo=True, truncate_prompt_tokens=3)
    assert echoed.usage.prompt_tokens == 3
    assert echoed.choices[0].text.startswith(llm.handle.tokenizer.decode(ids[-3:]))
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=2, extra_body={"truncate_prompt_tokens": 5}, **GREEDY
    )
    assert chat.usage.prompt_tokens == 5
    for bad in (0, -2, room + 1):
        with pytest.raises(openai.BadRequestError, match=rf"truncate_prompt_tokens = {bad}: must be -1 .* to {room}"):
            complete(long, truncate_prompt_tokens=bad)
    assert llm.stats()["kv_pages_held"] == 0


def test_chat_and_completions_match_grpc_and_offline(api):
    llm, server, addr, base, client, _ = api
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, extra_body=NO_EOS, **GREEDY)
    completion = client.completions.create(
        model="tiny", prompt="The capital of France", max_tokens=12, extra_body=NO_EOS, **GREEDY
    )
    with Client(addr) as c:
        grpc_chat = c.generate(CHAT, max_tokens=12, ignore_eos=True, **GREEDY)
        grpc_text = c.generate("The capital of France", max_tokens=12, ignore_eos=True, **GREEDY)
    params = SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)
    offline = llm.generate(["The capital of France"], params)[0]
    assert chat.choices[0].message.content == grpc_chat.text and grpc_chat.text
    assert chat.choices[0].message.role == "assistant"
    assert completion.choices[0].text == grpc_text.text == offline.text
    # vLLM's top_k = -1 (no top-k) is taken over HTTP and gRPC alike
    every = client.completions.create(
        model="tiny", prompt="The capital of France", max_tokens=12, extra_body={**NO_EOS, "top_k": -1}, **GREEDY
    )
    with Client(addr) as c:
        assert (
            c.generate("The capital of France", max_tokens=12, ignore_eos=True, top_k=-1, **GREEDY).text == offline.text
        )
    assert every.choices[0].text == offline.text
    assert chat.choices[0].finish_reason == completion.choices[0].finish_reason == "length"
    usage = completion.usage
    assert usage.completion_tokens == 12 and usage.prompt_tokens == len(llm.handle.encode("The capital of France"))
    assert usage.total_tokens == usage.prompt_tokens + 12


def test_streaming_sync_and_async_give_the_same_text(api):
    llm, server, addr, base, client, _ = api
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, extra_body=NO_EOS, **GREEDY)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as aclient:
            streams = [
                await aclient.completions.create(
                    model="tiny", prompt=f"Machine learning {i}", max_tokens=8, stream=True, extra_body=NO_EOS, **GREEDY
                )
                for i in range(4)
            ]

            async def read(s):
                return "".join([c.choices[0].text async for c in s])

            streamed = await asyncio.gather(*(read(s) for s in streams))
            whole = await asyncio.gather(
                *(
                    aclient.completions.create(
                        model="tiny", prompt=f"Machine learning {i}", max_tokens=8, extra_body=NO_EOS, **GREEDY
                    )
                    for i in range(4)
                )
            )
            return streamed, [w.choices[0].text for w in whole]

    streamed, whole = asyncio.run(run())
    assert streamed == whole


def test_n_samples_several_prompts_and_echo(api):
    llm, server, addr, base, client, _ = api
    out = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=6, n=2, temperature=1.0, seed=7, extra_body=NO_EOS
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len(llm.handle.encode(CHAT))  # once, not per sample
    prompts = ["Deep learning", "The capital"]
    many = client.completions.create(model="tiny", prompt=prompts, max_tokens=4, n=2, extra_body=NO_EOS, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text  # greedy samples of one prompt agree
    alone = [
        client.completions.create(model="tiny", prompt=p, max_tokens=4, extra_body=NO_EOS, **GREEDY) for p in prompts
    ]
    assert [many.choices[0].text, many.choices[2].text] == [a.choices[0].text for a in alone]
    echo = client.completions.create(
        model="tiny", prompt="Deep learning", max_tokens=4, echo=True, extra_body=NO_EOS, **GREEDY
    )
    assert echo.choices[0].text == "Deep learning" + alone[0].choices[0].text
    ids = client.completions.create(
        model="tiny", prompt=llm.handle.encode("Deep learning"), max_tokens=4, extra_body=NO_EOS, **GREEDY
    )
    assert ids.choices[0].text == alone[0].choices[0].text


def test_logprobs_match_grpc(api):
    llm, server, addr, base, client, _ = api
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=3, extra_body=NO_EOS, **GREEDY
    )
    with Client(addr) as c:
        ref = c.generate(CHAT, max_tokens=5, logprobs=3, ignore_eos=True, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(list(ref.logprobs), abs=1e-6)
    assert all(len(e.top_logprobs) == 3 for e in content)
    # logprobs = true alone (no top_logprobs), streamed or not: each token's own logprob
    # and an empty top list (both were a ValueError: a 500, a stream cut off)
    alone = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, logprobs=True, extra_body=NO_EOS, **GREEDY
    )
    own = alone.choices[0].logprobs.content
    assert [e.logprob for e in own] == pytest.approx([e.logprob for e in content], abs=1e-6)
    assert all(e.top_logprobs == [] for e in own)
    stream = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, logprobs=True, stream=True, extra_body=NO_EOS, **GREEDY
    )
    chunks = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [e.logprob for lp in chunks for e in lp.content] == pytest.approx([e.logprob for e in own], abs=1e-6)
    assert [e.token for e in content] == [llm.handle.tokenizer.decode([t]) for t in ref.token_ids]
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    completion = client.completions.create(
        model="tiny", prompt="Deep learning", max_tokens=4, logprobs=2, extra_body=NO_EOS, **GREEDY
    )
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == completion.choices[0].text


def test_chat_logprobs_bytes_are_each_tokens_own(api):
    """OpenAI's `bytes`: a token that is a piece of a character carries that piece (its
    `token` text shows U+FFFD), so the pieces' bytes joined give the character."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    llm, server, addr, base, client, _ = api
    chat = client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=8,
        logprobs=True,
        top_logprobs=5,
        extra_body={"guided_choice": ["日本"]},  # the tiny BPE knows no merge of these: a token a byte
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == "日本" and len(content) == 6
    assert all(e.token == "\ufffd" for e in content)
    assert b"".join(bytes(e.bytes) for e in content).decode() == "日本"
    # Every entry, chosen or not, is some token's bytes (the byte-level BPE's own table
    # from characters back to bytes) and reads as its `token` text.
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tok = llm.handle.tokenizer
    special = set(tok.all_special_tokens)
    pieces = {p.encode() if p in special else bytes(byte_of[c] for c in p) for p in tok.get_vocab()}
    pieces.add(b"")  # the model's rows past the tokenizer's ~300 tokens: no text
    entries = [*content, *(t for e in content for t in e.top_logprobs)]
    assert len(entries) == 6 + 6 * 5
    for e in entries:
        assert bytes(e.bytes) in pieces and bytes(e.bytes).decode(errors="replace") == e.token, e


def test_stop_reason_is_vllms_none_at_the_end_of_sequence_token(api):
    """vLLM's stop_reason: None when the tokenizer's EOS ended the output, the id of a
    requested stop token, the stop string; the engine's own reason names EOS too."""
    llm, server, addr, base, client, _ = api
    eos = llm.handle.tokenizer.eos_token_id
    other = llm.handle.encode("Paris")[0]
    text = llm.handle.tokenizer.decode([other])
    forced = lambda token, **extra: dict(logit_bias={str(token): 100}, extra_body=extra)  # noqa: E731
    for make in (client.completions.create, client.chat.completions.create):
        for kwargs, reason in [
            (forced(eos), None),
            (forced(other, stop_token_ids=[other]), other),
            (forced(other, stop=[text]), text),
        ]:
            prompt = dict(prompt="Deep learning") if make == client.completions.create else dict(messages=CHAT)
            out = make(model="tiny", max_tokens=4, **prompt, **kwargs, **GREEDY)
            choice = out.choices[0]
            assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == reason, (kwargs, choice)
            last = list(make(model="tiny", max_tokens=4, stream=True, **prompt, **kwargs, **GREEDY))[-1].choices[0]
            assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == reason, (kwargs, last)
    with Client(addr) as c:  # gRPC keeps naming the token
        assert c.generate("Deep learning", max_tokens=4, logit_bias={eos: 100}).stop_token_id == eos


def _sentencepiece_style_tokenizer():
    """Llama 2's and Mistral's kind: words carry a leading "▁", unknown characters fall
    back to <0xNN> byte tokens, and decoding strips the text's first space."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    merges = [("▁", "P"), ("▁P", "a"), ("▁Pa", "r"), ("i", "s"), ("▁Par", "is"), ("▁", "o"), ("▁o", "f")]
    for piece in dict.fromkeys(p for pair in merges for p in (*pair, "".join(pair))):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", unk_token="<unk>")


def test_logprobs_tokens_add_up_to_the_text_with_a_sentencepiece_tokenizer():
    """Each token's text is its own bytes: a SentencePiece tokenizer's decode of one token
    drops its leading space ("▁Paris" -> "Paris"), so the tokens did not add up to the text
    that followed the prompt."""
    from types import SimpleNamespace

    from jaxserve.engine.structured import GrammarCompiler
    from jaxserve.server.openai_reply import ReplyFormatter

    tok = _sentencepiece_style_tokenizer()
    grammars = GrammarCompiler(tok, None, {tok.eos_token_id})
    reply = ReplyFormatter(SimpleNamespace(tokenizer=tok, token_bytes=grammars.token_bytes))
    prompt, generated = (
        tok.encode("Paris", add_special_tokens=False),
        tok.encode("of Paris 日", add_special_tokens=False),
    )
    whole = tok.decode(prompt + generated)
    assert whole == "Paris of Paris 日" and len(generated) == 6  # ▁of ▁Paris ▁ <0xE6> <0x97> <0xA5>
    lps = [-1.0] * len(generated)
    chat = reply.chat_logprobs(generated, lps, [[]] * len(generated))["content"]
    assert [e["token"] for e in chat[:3]] == [" of", " Paris", " "]
    assert b"".join(bytes(e["bytes"]) for e in chat).decode() == whole[len("Paris") :]
    completion = reply.completion_logprobs(generated, lps, [None] * len(generated), len("Paris"))
    assert "".join(completion["tokens"][:3]) == " of Paris "
    assert completion["text_offset"][:3] == [5, 8, 14]


def test_null_is_a_fields_default_as_in_openais_api(api):
    """Clients that send every field send null for those they leave unset ("n": null,
    "stream": null, "logprobs": null): OpenAI's API reads their defaults, so does ours.
    A required field's null stays one 400 naming it."""
    llm, server, addr, base, client, _ = api
    fixed = {"model": "tiny", "max_tokens": 4, "temperature": 0.0}
    unset = dict.fromkeys(["n", "stream", "stop", "seed", "ignore_eos", "min_tokens", "skip_special_tokens"])
    for path, body in [
        ("completions", {"prompt": "Deep learning", "echo": None, "logprobs": None, **unset}),
        ("chat/completions", {"messages": CHAT, "logprobs": None, "top_logprobs": None, **unset}),
    ]:
        plain = httpx.post(f"{base}/v1/{path}", json={**{k: v for k, v in body.items() if v is not None}, **fixed})
        nulls = httpx.post(f"{base}/v1/{path}", json={**body, **fixed})
        assert plain.status_code == nulls.status_code == 200, nulls.json()
        assert nulls.json()["choices"] == plain.json()["choices"]
    missing = httpx.post(f"{base}/v1/chat/completions", json={"messages": None})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages", missing.json()


def test_an_unknown_field_is_ignored_and_logged_once_as_vllm_does(api, caplog):
    """A field the server does not know changes nothing (vLLM's server drops it too), and
    the log names it once, in the body or a message where it was: a misspelt option
    (``temprature``) is otherwise silently without effect."""
    llm, server, addr, base, client, _ = api
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 4, "temperature": 0.0}
    plain = httpx.post(f"{base}/v1/chat/completions", json=body).json()
    messages = [{**CHAT[0], "unknown_in_a_message": 1}, CHAT[1]]
    odd = {**body, "messages": messages, "temprature": 1.5}
    with caplog.at_level("WARNING", logger="jaxserve.server.openai_protocol"):
        for _ in range(2):
            reply = httpx.post(f"{base}/v1/chat/completions", json=odd)
            assert reply.status_code == 200 and reply.json()["choices"] == plain["choices"]
    logged = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
    assert logged == [
        "a request's ChatRequest has a field this server ignores: 'temprature' (logged once)",
        "a request's ChatMessage has a field this server ignores: 'unknown_in_a_message' (logged once)",
    ], logged


def test_echo_with_logprobs_scores_the_prompt_as_eval_harnesses_ask(api):
    """lm-eval's loglikelihood request over OpenAI's API: echo, logprobs, max_tokens 1 (or 0).
    The choice's logprobs cover the prompt's tokens (the first has none) then the output's:
    the prompt's are its prompt_logprobs, the last is the plain request's (vLLM's shape)."""
    llm, server, addr, base, client, _ = api
    prompts = ["Deep learning is", "The capital of France"]
    echo = client.completions.create(model="tiny", prompt=prompts, max_tokens=1, logprobs=2, echo=True, **GREEDY)
    for prompt, choice in zip(prompts, echo.choices, strict=True):
        ids = llm.handle.encode(prompt)
        scored = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=1, logprobs=2, extra_body={"prompt_logprobs": 2}, **GREEDY
        ).choices[0]
        lp = choice.logprobs
        assert choice.text == prompt + scored.text
        assert lp.tokens == [llm.handle.tokenizer.decode([t]) for t in ids] + scored.logprobs.tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        prompt_lps = scored.model_extra["prompt_logprobs"][1:]
        expected = [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], prompt_lps, strict=True)]
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-6)
        assert lp.token_logprobs[len(ids) :] == pytest.approx(scored.logprobs.token_logprobs, abs=1e-6)
        assert all(len(top) == 2 for top in lp.top_logprobs[1:])
        assert lp.text_offset[0] == 0 and "".join(lp.tokens) == choice.text
    only_prompt = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=0, logprobs=1, echo=True)
    assert only_prompt.choices[0].text == prompts[0] and only_prompt.usage.completion_tokens == 0
    assert only_prompt.choices[0].logprobs.token_logprobs == pytest.approx(
        echo.choices[0].logprobs.token_logprobs[:-1], abs=1e-6
    )


def test_chat_prompt_logprobs_are_the_completions_of_its_prompt(api):
    """vLLM's extra on chat: the templated prompt's logprobs, on the response (one prompt
    for every choice), as a completion of the same token ids gives them."""
    llm, server, addr, base, client, _ = api
    ids = httpx.post(f"{base}/tokenize", json={"model": "tiny", "messages": CHAT}).json()["tokens"]
    extra = {"prompt_logprobs": 2, **NO_EOS}
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, n=2, extra_body=extra)
    completion = client.completions.create(model="tiny", prompt=ids, max_tokens=2, extra_body=extra, **GREEDY)
    got, expected = chat.model_extra["prompt_logprobs"], completion.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None and all(len(entry) >= 2 for entry in got[1:])
    assert got == expected


def test_logit_bias_forces_and_bans_tokens_on_every_transport(api):
    llm, server, addr, base, client, _ = api
    forced = client.completions.create(
        model="tiny",
        prompt="Deep learning",
        max_tokens=5,
        logit_bias={"42": 100},
        logprobs=0,
        extra_body=NO_EOS,
        **GREEDY,
    )
    tokens = forced.choices[0].logprobs.tokens
    assert tokens == [llm.handle.tokenizer.decode([42])] * 5
    plain = llm.generate(["Deep learning"], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    banned = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logit_bias={plain: -100.0})
    offline = llm.generate(["Deep learning"], banned)[0]
    assert offline.token_ids[0] != plain
    with Client(addr) as c:
        over_grpc = c.generate("Deep learning", max_tokens=3, ignore_eos=True, logit_bias={plain: -100.0}, **GREEDY)
    over_http = client.completions.create(
        model="tiny", prompt="Deep learning", max_tokens=3, logit_bias={str(plain): -100}, extra_body=NO_EOS, **GREEDY
    )
    assert list(over_grpc.token_ids) == offline.token_ids
    assert over_http.choices[0].text == offline.text


def test_cached_tokens_in_usage(api):
    llm, server, addr, base, client, _ = api
    prompt = rng_tokens(120, 300, seed=41)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body=NO_EOS, **GREEDY)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body=NO_EOS, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 112  # whole pages of the first


BAD = [
    (dict(temperature=-1.0), "temperature", "temperature = -1.0: must be a number >= 0"),
    (dict(top_p=1.5), "top_p", "top_p = 1.5"),
    (dict(max_tokens=-2), "max_tokens", "max_tokens = -2"),
    (dict(max_tokens=5000), "max_tokens", "prompt .* \\+ max_tokens must be <= max_model_len"),
    (dict(n=0), "n", "n = 0: must be an integer in \\[1, 64\\]"),
    (dict(extra_body={"temperature": "hot"}), "temperature", "temperature: Input should be a valid number"),
    (dict(extra_body={"top_k": -5}), "top_k", "top_k = -5"),
    (dict(model="gpt-4"), "model", "model = 'gpt-4': this server serves 'tiny'"),
    (dict(prompt=""), "prompt", "prompt: the prompt is empty"),
    (dict(prompt=[1, 2, 999]), "prompt[2]", "prompt\\[2\\] = 999: out of range"),
    (dict(prompt=[1] * 1100), "prompt", r"^prompt: 1100 tokens; must be shorter than max_model_len \(1024\)$"),
    (dict(prompt=[[1, 2], [1] * 1100]), "prompt[1]", r"^prompt\[1\]: 1100 tokens; must be shorter"),
    # A union none of whose members takes the value: each named (was the first one's complaint:
    # "prompt: Input should be a valid string" for token ids that are not integers).
    (dict(prompt=[1.5]), "prompt", r"^prompt: must be one of str, list\[str\], list\[int\], list\[list\[int\]\]$"),
    (dict(stop=5), "stop", r"^stop: must be one of str, list\[str\]$"),
    # Types as strict as OpenAI's own API (pydantic's lax mode took true as token 1, "5" as 5).
    (dict(prompt=[True, False]), "prompt", r"^prompt: must be one of str, list\[str\], list\[int\]"),
    (dict(max_tokens=True), "max_tokens", "max_tokens: Input should be a valid integer"),
    (
        dict(extra_body={"stop_token_ids": ["7"]}),
        "stop_token_ids[0]",
        "stop_token_ids\\[0\\]: Input should be a valid integer",
    ),
    (dict(extra_body={"ignore_eos": "yes"}), "ignore_eos", "ignore_eos: Input should be a valid boolean"),
    (
        dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}}),
        "response_format",
        "response_format: .*bogus",
    ),
    (dict(extra_body={"response_format": {"type": "yaml"}}), "response_format.type", "must be one of text"),
    (dict(extra_body={"guided_regex": "(open"}), "guided_regex", "guided_regex: .*unclosed"),
    (
        dict(extra_body={"guided_regex": "a", "guided_choice": ["a"]}),
        "guided_choice",
        "only one structured-output constraint",
    ),
    (dict(logit_bias={"5000": 1.0}), "logit_bias", "logit_bias: token id 5000 is out of range; allowed 0..319"),
    (dict(logit_bias={"x": 1.0}), "logit_bias", "logit_bias: keys must be token ids"),
    (
        dict(logit_bias={"5": 300.0}),
        "logit_bias",
        r"logit_bias: token 5's bias 300.0: must be a number in \[-100, 100\]",
    ),
    (dict(extra_body={"stop_token_ids": [7, 5000]}), "stop_token_ids[1]", r"stop_token_ids\[1\] = 5000: out of range"),
    (dict(extra_body={"guided_choice": []}), "guided_choice", "guided_choice: must be a non-empty list of strings"),
    (dict(stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs", "not available with stream = true"),
    (dict(suffix="end"), "suffix", "suffix: not supported"),
    (dict(echo=True, logprobs=1, stream=True), "echo", "echo: with logprobs, not available with stream = true"),
]


@pytest.mark.parametrize("kwargs, param, message", BAD)
def test_a_bad_value_is_a_400_naming_the_field(api, kwargs, param, message):
    llm, server, addr, base, client, _ = api
    args = dict(model="tiny", prompt="Deep learning", max_tokens=4) | kwargs
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as e:
        client.completions.create(**args)
    error = e.value.body
    assert error["param"] == param, error
    assert re.search(message, error["message"], re.S), error


def test_bad_chat_input_and_bodies_are_400(api):
    llm, server, addr, base, client, _ = api
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "hi"}])
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:  # each member as the client sends it, no class name
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": 5}])
    body = e.value.body
    assert (body["param"], body["message"]) == (
        "messages[0].content",
        "messages[0].content: must be one of str, list[object]",
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=-1)
    assert e.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:  # too long: the field the client sent, not "prompt"
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * 1200}])
    assert e.value.body["param"] == "messages" and re.match(
        r"messages: \d+ tokens; must be shorter", e.value.body["message"]
    )
    with pytest.raises(openai.BadRequestError) as e:  # the field the client set, not the one it maps to
        client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True, top_logprobs=30)
    assert e.value.body["param"] == "top_logprobs" and e.value.body["message"].startswith("top_logprobs = 30: ")
    raw = httpx.post(f"{base}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert raw.json()["error"]["message"] == "the body is not valid JSON: key must be a string at line 1 column 2"
    deep = {}
    for _ in range(300):  # valid JSON, nested past the parser's limit
        deep = {"a": deep}
    raw = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi", "guided_json": deep})
    assert raw.status_code == 400 and "recursion limit exceeded" in raw.json()["error"]["message"]
    missing = httpx.post(f"{base}/v1/completions", json={"model": "tiny"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
    # Unknown fields are ignored, as OpenAI's API does.
    ok = httpx.post(
        f"{base}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0, "no_such_field": 1},
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


def test_structured_output_over_http_and_grpc(api):
    llm, server, addr, base, client, _ = api
    schema = PET_SCHEMA
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=60, temperature=1.0, seed=3, response_format=fmt
    )
    assert chat.choices[0].finish_reason == "stop"
    pet = json.loads(chat.choices[0].message.content)
    assert pet["kind"] in ("cat", "dog") and 0 <= pet["age"] <= 9
    regex = r"[0-9]{2}-[a-c]{3}"
    done = client.completions.create(
        model="tiny", prompt="Deep learning", max_tokens=30, temperature=1.0, seed=4, extra_body={"guided_regex": regex}
    )
    assert re.fullmatch(regex, done.choices[0].text)
    picked = client.completions.create(
        model="tiny",
        prompt="Deep",
        max_tokens=30,
        n=3,
        temperature=1.0,
        extra_body={"guided_choice": ["left", "right"]},
    )
    assert {c.text for c in picked.choices} <= {"left", "right"}
    # The same request over gRPC and offline gives the same text.
    with Client(addr) as c:
        over_grpc = c.generate("Deep learning", max_tokens=30, temperature=1.0, seed=4, regex=regex)
        with pytest.raises(grpc.RpcError) as e:
            c.generate("Deep learning", max_tokens=3, regex="(open")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert re.search("sampling_params.regex: .*unclosed", e.value.details(), re.S)
    offline = llm.generate(["Deep learning"], SamplingParams(max_tokens=30, temperature=1.0, seed=4, regex=regex))[0]
    assert over_grpc.text == offline.text == done.choices[0].text


def test_an_assistant_prefill_is_continued_not_answered(api):
    """vLLM's continue_final_message (with add_generation_prompt = false): the last message
    stays open, so the reply goes on from the prefill, as /tokenize renders it; without it
    the turn is closed (add_generation_prompt = false alone), and both flags at once are
    one 400 naming the field."""
    llm, server, addr, base, client, _ = api
    tok = llm.handle.tokenizer
    prefill = [*CHAT, {"role": "assistant", "content": "The capital"}]
    open_turn = {"add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(f"{base}/tokenize", json={"messages": prefill, **open_turn}).json()["tokens"]
    assert tok.decode(ids).endswith("<|im_start|>assistant\nThe capital"), tok.decode(ids)
    closed = httpx.post(f"{base}/tokenize", json={"messages": prefill, "add_generation_prompt": False}).json()
    assert tok.decode(closed["tokens"]).endswith("<|im_start|>assistant\nThe capital<|im_end|>\n")
    assert closed["tokens"][: len(ids)] == ids

    chat = client.chat.completions.create(
        model="tiny", messages=prefill, max_tokens=6, extra_body={**open_turn, **NO_EOS}, **GREEDY
    )
    offline = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert chat.usage.prompt_tokens == len(ids) and chat.choices[0].message.content == offline.text

    both = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "tiny", "messages": prefill, "continue_final_message": True, "max_tokens": 2},
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message", both.text

    # gRPC's ChatMessages take the same options: the same prompt, the same reply
    with Client(addr) as c:
        over_grpc = c.generate(prefill, max_tokens=6, ignore_eos=True, temperature=0.0, **open_turn)
        assert over_grpc.usage.prompt_tokens == len(ids) and over_grpc.text == offline.text
        closed_turn = c.generate(prefill, max_tokens=1, add_generation_prompt=False)
        assert closed_turn.usage.prompt_tokens == len(closed["tokens"])
        with pytest.raises(grpc.RpcError) as e:
            c.generate(prefill, max_tokens=2, continue_final_message=True)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("chat.continue_final_message = true: only with"), e.value.details()
        with pytest.raises(RequestError, match="for a chat prompt only"):
            c.generate("The capital", max_tokens=2, add_generation_prompt=False)


def test_a_chat_for_a_model_without_a_chat_template_is_one_400(api, monkeypatch):
    """A base model's tokenizer has no chat template: a chat is a 400 naming messages (it
    was transformers' ValueError, a 500 with a traceback), on /tokenize too, and over gRPC
    INVALID_ARGUMENT naming chat.messages; the offline LLM raises a RequestError."""
    llm, server, addr, base, client, _ = api
    monkeypatch.setattr(llm.handle.tokenizer, "chat_template", None)
    for path, body in (("/v1/chat/completions", {"max_tokens": 2}), ("/tokenize", {})):
        r = httpx.post(f"{base}{path}", json={"model": "tiny", "messages": CHAT, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "no chat template" in r.json()["error"]["message"]
    with Client(addr) as c, pytest.raises(grpc.RpcError) as e:
        c.generate(CHAT, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("chat.messages: this model's tokenizer has no chat template"), e.value.details()
    with pytest.raises(RequestError, match="no chat template"):
        llm.generate([CHAT], SamplingParams(max_tokens=2))


def test_chat_template_kwargs_set_the_templates_variables(api, monkeypatch):
    """vLLM's chat_template_kwargs (Qwen3's {"enable_thinking": false}) reach the template as
    variables, on chats and /tokenize alike; a name the request sets itself is one 400."""
    llm, server, addr, base, client, _ = api
    tok = llm.handle.tokenizer
    switch = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    monkeypatch.setattr(tok, "chat_template", tok.chat_template + switch)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = httpx.post(f"{base}/tokenize", json={"messages": CHAT}).json()["tokens"]
    thinking_off = httpx.post(f"{base}/tokenize", json={"messages": CHAT, **off}).json()["tokens"]
    assert tok.decode(thinking_off) == tok.decode(plain) + "<think></think>"
    on = httpx.post(f"{base}/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}})
    assert on.json()["tokens"] == plain
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, extra_body=off, **GREEDY)
    assert chat.usage.prompt_tokens == len(thinking_off)
    assert [o.prompt_token_ids for o in llm.chat(CHAT, SamplingParams(max_tokens=1), **off)] == [thinking_off]
    for kwargs, param in (
        ({"tokenize": True}, "tokenize"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
    ):
        r = httpx.post(
            f"{base}/v1/chat/completions", json={"model": "tiny", "messages": CHAT, "chat_template_kwargs": kwargs}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith(f"chat_template_kwargs.{param}: not a variable"), r.text
    with pytest.raises(RequestError, match="chat_template_kwargs.messages: not a variable"):
        llm.chat(CHAT, SamplingParams(max_tokens=1), chat_template_kwargs={"messages": []})
    with Client(addr) as c:  # gRPC's ChatMessages.chat_template_kwargs, a JSON object
        over_grpc = c.generate(CHAT, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
        assert over_grpc.usage.prompt_tokens == len(thinking_off)
        for bad, said in (
            (["enable_thinking"], "chat.chat_template_kwargs: a JSON object"),
            ({"tokenize": True}, "chat.chat_template_kwargs.tokenize: not a variable"),
        ):
            with pytest.raises(grpc.RpcError) as e:
                c.generate(CHAT, max_tokens=1, chat_template_kwargs=bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert e.value.details().startswith(said), e.value.details()
    assert llm.stats()["kv_pages_held"] == 0


def _events(base: str, path: str, body: dict) -> list[dict]:
    """A streamed response's chunks, as JSON, up to [DONE]."""
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_return_token_ids_gives_the_prompts_and_outputs_ids_as_vllm(api):
    """vLLM's return_token_ids (RL trainers read them): a completion's choices carry the
    prompt's and their own token ids, a chat's response the prompt's and each choice its
    own; streamed, each chunk its own ids and the first the prompt's, adding up to the
    whole response's."""
    llm, server, addr, base, client, _ = api
    prompt = "The capital of France"
    offline = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    completion = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "return_token_ids": True, **NO_EOS, **GREEDY}
    (choice,) = httpx.post(f"{base}/v1/completions", json=completion).json()["choices"]
    assert choice["prompt_token_ids"] == llm.handle.encode(prompt)
    assert choice["token_ids"] == offline.token_ids and choice["text"] == offline.text
    chunks = [c["choices"][0] for c in _events(base, "/v1/completions", completion) if c["choices"]]
    assert [c.get("prompt_token_ids") for c in chunks] == [llm.handle.encode(prompt)] + [None] * (len(chunks) - 1)
    assert [t for c in chunks for t in c["token_ids"]] == offline.token_ids

    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 5, "return_token_ids": True, **NO_EOS, **GREEDY}
    whole = httpx.post(f"{base}/v1/chat/completions", json=chat).json()
    assert whole["prompt_token_ids"] == llm.handle.encode(CHAT)
    ids = whole["choices"][0]["token_ids"]
    answered = llm.generate([whole["prompt_token_ids"]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert ids == answered[0].token_ids and whole["choices"][0]["message"]["content"] == answered[0].text
    streamed = _events(base, "/v1/chat/completions", chat)
    assert streamed[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in streamed[1:])
    assert [t for c in streamed[1:] for t in c["choices"][0]["token_ids"]] == ids
    plain = httpx.post(f"{base}/v1/completions", json={**completion, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    assert llm.stats()["kv_pages_held"] == 0


def test_vllm_fields_not_implemented_are_refused_not_dropped(api):
    """A vLLM field this server does not implement, set to anything but vLLM's default, is
    one 400 naming it and what stands for it here: dropped like an unknown field, it would
    change the output unannounced (allowed_token_ids unconstrained, a cache_salt's
    isolation absent). vLLM's defaults pass, and completions' own echo is not touched."""
    llm, server, addr, base, client, _ = api
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 2}
    completion = {"model": "tiny", "prompt": "The capital", "max_tokens": 2}
    refused = [
        ("chat", "allowed_token_ids", [5, 6], "logit_bias, or a structured output"),
        ("completions", "bad_words", ["Paris"], "logit_bias of -100"),
        ("completions", "use_beam_search", True, "no beam search"),
        ("chat", "cache_salt", "tenant-a", "the prefix cache is shared by every request"),
        ("chat", "echo", True, "/v1/completions' echo is"),
        ("chat", "chat_template", "{{ messages }}", "the model's own template"),
        ("completions", "prompt_embeds", "AAAA", "prompts are text or token ids"),
        ("completions", "truncation_side", "right", "keeps a prompt's last tokens"),
        ("chat", "priority", 5, "first come, first served"),
    ]
    for endpoint, field, value, why in refused:
        body = {**(chat if endpoint == "chat" else completion), field: value}
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        r = httpx.post(f"{base}{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
        message = r.json()["error"]["message"]
        assert message.startswith(f"{field} = {json.dumps(value)}: vLLM's field") and why in message, message
    defaults = {
        "spaces_between_special_tokens": True,
        "priority": 0,
        "length_penalty": 1.0,
        "truncation_side": "left",
        "use_beam_search": False,
        "allowed_token_ids": None,
        "bad_words": [],
    }
    assert httpx.post(f"{base}/v1/chat/completions", json={**chat, **defaults, "echo": False}).status_code == 200
    echoed = httpx.post(f"{base}/v1/completions", json={**completion, **defaults, "echo": True})
    assert echoed.status_code == 200 and echoed.json()["choices"][0]["text"].startswith("The capital")
    assert llm.stats()["kv_pages_held"] == 0


def test_tokenize_and_detokenize(api):
    llm, server, addr, base, client, _ = api
    ids = llm.handle.encode("Deep learning")
    got = httpx.post(f"{base}/tokenize", json={"prompt": "Deep learning"}).json()
    assert got["tokens"] == ids and got["count"] == len(ids)
    chat = httpx.post(f"{base}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == llm.handle.encode(CHAT)
    assert httpx.post(f"{base}/detokenize", json={"tokens": ids}).json()["prompt"] == "Deep learning"
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [1, True]})  # not token 1
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]", bad.json()
    # What lm-eval's remote tokenizer reads: the special tokens (ids by /tokenize) and the template.
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"]) == ("<|im_end|>", "<|im_start|>"), info
    assert (
        info["chat_template"] == llm.handle.tokenizer.chat_template
        and info["model_max_length"] == llm.handle.max_model_len
    )
    eos = httpx.post(f"{base}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [llm.handle.tokenizer.eos_token_id]


def _wait_until_idle(llm, server) -> None:
    idle = lambda: not server.engine_thread.num_active and not llm.stats()["kv_pages_held"]  # noqa: E731
    wait_until(idle, "no request in the engine and no page held", detail=llm.stats)


def test_continuous_usage_stats_counts_every_chunk_as_vllm(api):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries
    its choice's counts so far (a benchmark client counts tokens from them), chats and
    completions alike, n > 1 included; without include_usage it does nothing, as there."""
    llm, server, _, base, client, _ = api
    options = {"include_usage": True, "continuous_usage_stats": True}
    prompt = "The capital of France"
    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, n=2, logprobs=1, stream=True, stream_options=options,
            extra_body=NO_EOS, temperature=1.0, seed=3,
        )
    )  # fmt: skip
    prompt_tokens = len(llm.handle.encode(prompt))
    generated = {0: 0, 1: 0}
    for c in chunks[:-1]:
        (choice,) = c.choices
        generated[choice.index] += len(choice.logprobs.tokens)  # this chunk's tokens
        assert c.usage.prompt_tokens == prompt_tokens
        assert c.usage.completion_tokens == generated[choice.index]
        assert c.usage.total_tokens == prompt_tokens + generated[choice.index]
    assert generated == {0: 6, 1: 6}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    chat = list(
        client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=5, stream=True, stream_options=options, extra_body=NO_EOS, **GREEDY
        )
    )
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    steps = [c.usage.completion_tokens for c in chat[1:-1]]
    assert steps == sorted(steps) and steps[-1] == 5 and chat[-1].usage.completion_tokens == 5
    assert all(c.usage.prompt_tokens == chat[-1].usage.prompt_tokens for c in chat)
    plain = list(
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=3, stream=True, stream_options={"include_usage": False,
            "continuous_usage_stats": True}, extra_body=NO_EOS, **GREEDY,
        )
    )  # fmt: skip
    assert all(c.usage is None for c in plain)
    assert llm.stats()["kv_pages_held"] == 0


def test_responses_api_answers_as_the_chat_does(api):
    """OpenAI's Responses API (POST /v1/responses) with the official client: instructions +
    input run as the chat of the same messages (the same prompt ids, the same greedy text),
    as a response object or a stream of OpenAI's events in order, which the client's own
    stream helper assembles; cut at max_output_tokens is status "incomplete"."""
    llm, server, addr, base, client, _ = api
    messages = [{"role": "user", "content": "The capital of France?"}]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, *messages], max_tokens=8,
        extra_body=NO_EOS, **GREEDY,
    )  # fmt: skip
    args = dict(model="tiny", instructions="Be brief.", max_output_tokens=8, extra_body=NO_EOS, **GREEDY)
    answer = client.responses.create(input=messages, **args)
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens and answer.usage.output_tokens == 8
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.id.startswith("resp_") and answer.output[0].role == "assistant"

    with client.responses.stream(input=messages, **args) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert deltas >= 1 and final.output_text == answer.output_text and final.status == "incomplete"
    raw = _events(base, "/v1/responses", {"model": "tiny", "input": "Deep learning", "max_output_tokens": 4})
    assert [e["sequence_number"] for e in raw] == list(range(len(raw)))
    text = "".join(e["delta"] for e in raw if e["type"] == "response.output_text.delta")
    assert raw[-1]["response"]["output"][0]["content"][0]["text"] == text

    plain = client.responses.create(model="tiny", input="Deep learning", max_output_tokens=4, **GREEDY)
    offline = llm.chat([{"role": "user", "content": "Deep learning"}], SamplingParams(max_tokens=4, temperature=0.0))
    assert plain.output_text == offline[0].text
    assert llm.stats()["kv_pages_held"] == 0


def test_responses_api_structured_output_and_refusals(api):
    """text.format (json_schema) constrains the answer as response_format does; what the
    server does not do (tools, stored responses, items that are not messages, images, a
    truncation that cuts) is one 400 naming the field."""
    llm, server, addr, base, client, _ = api
    schema = PET_SCHEMA
    pet = client.responses.create(
        model="tiny", input="A pet?", max_output_tokens=60, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "pet", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert pet.status == "completed"
    got = json.loads(pet.output_text)
    assert got["kind"] in ("cat", "dog") and 0 <= got["age"] <= 9
    refused = [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
    ]  # fmt: skip
    for extra, param in refused:
        r = httpx.post(f"{base}/v1/responses", json={"model": "tiny", "input": "hi", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    # the defaults that ask for nothing more pass
    ok = {"store": True, "truncation": "disabled", "tools": [], "tool_choice": "auto", "include": []}
    ok |= {"background": False, "top_logprobs": 0, "reasoning": {}}  # OpenAI's and vLLM's defaults
    assert (
        httpx.post(
            f"{base}/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 2, **ok}
        ).status_code
        == 200
    )
    assert llm.stats()["kv_pages_held"] == 0


def test_an_unknown_route_or_a_stored_response_is_openais_error_body(api):
    """An unknown path or method is OpenAI's error body naming the routes served (FastAPI's
    own said {"detail": "Not Found"}); the Responses API's retrieve, delete and cancel say
    that nothing is kept, and the openai client raises NotFoundError."""
    llm, server, addr, base, client, _ = api
    missing = httpx.post(f"{base}/v1/embeddings", json={"input": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert missing.json()["error"]["message"].startswith("no route POST /v1/embeddings; served: ")
    assert "POST /v1/responses" in missing.json()["error"]["message"]
    wrong_method = httpx.get(f"{base}/v1/chat/completions")
    assert wrong_method.status_code == 405 and "no route GET /v1/chat/completions" in wrong_method.text
    with pytest.raises(openai.NotFoundError, match="this server keeps no responses"):
        client.responses.retrieve("resp_123")
    cancelled = httpx.post(f"{base}/v1/responses/resp_123/cancel")
    assert cancelled.status_code == 404 and cancelled.json()["error"]["param"] == "response_id"


def test_a_disconnected_stream_or_call_frees_its_pages(api):
    llm, server, addr, base, client, _ = api
    _wait_until_idle(llm, server)
    body = {"model": "tiny", "prompt": rng_tokens(40, 300, seed=9), "max_tokens": 900, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{base}/v1/completions", json=body | {"stream": True}) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
            assert server.engine_thread.num_active == 1
        # Closed: the engine aborts it at a step boundary and its pages go back.
    _wait_until_idle(llm, server)
    stream = [s for s in server.engine_thread.aborted.items() if s[0] == "cancelled"]
    assert stream and stream[0][1] >= 1

    # Not streaming: the client gives up (a read timeout) before the request can finish
    # (the engine thread is held between steps until then), and goes away.
    before = server.engine_thread.aborted["cancelled"]
    with engine_held(server.engine_thread), pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    _wait_until_idle(llm, server)
    assert server.engine_thread.aborted["cancelled"] == before + 1

    # A streamed Responses API answer closed early: aborted as well.
    before = server.engine_thread.aborted["cancelled"]
    answer = {"model": "tiny", "input": "Deep learning", "max_output_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{base}/v1/responses", json=answer) as response:
        lines = response.iter_lines()
        next(line for line in lines if '"response.output_text.delta"' in line)
    _wait_until_idle(llm, server)
    assert server.engine_thread.aborted["cancelled"] == before + 1
    assert llm.stats()["kv_pages_held"] == 0
    llm.scheduler.check_integrity()


def test_a_full_queue_is_429_then_recovers(tiny_model_dir):
    from tests.conftest import tiny_server

    config = ServerConfig(port=0, http_port=0, metrics_port=None, max_waiting_requests=2, warmup=False)
    with tiny_server(tiny_model_dir("llama3")[0], config, num_pages=200, max_num_seqs=2) as (llm, server, addr):
        base = f"http://127.0.0.1:{server.http_port}/v1"

        async def run():
            async with openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0) as aclient:

                async def one(i):
                    try:
                        await aclient.completions.create(
                            model="tiny", prompt=[5, 6, 7 + i], max_tokens=40, extra_body=NO_EOS, **GREEDY
                        )
                        return "ok"
                    except openai.RateLimitError as e:
                        assert e.body["code"] == "rate_limit_exceeded"
                        return 429

                return await asyncio.gather(*(one(i) for i in range(12)))

        codes = asyncio.run(run())
        assert 429 in codes and "ok" in codes
        with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as c:
            assert c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, **GREEDY).usage.completion_tokens


def test_a_client_gone_before_its_answer_is_a_quiet_499():
    """The disconnect won the race: the work was cancelled but not yet done when its result
    was read (an InvalidStateError traceback in the server's log per such client); its
    cleanup (the requests' aborts) ran after the answer was chosen."""
    from jaxserve.server.openai_api import OpenAIServer

    cleaned = []

    class Gone:
        async def receive(self):
            return {"type": "http.disconnect"}

    async def work():
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append(True)

    response = asyncio.run(OpenAIServer._unless_disconnected(OpenAIServer, Gone(), work()))
    assert response.status_code == 499 and cleaned == [True]
