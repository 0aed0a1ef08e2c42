from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve.engine.detokenizer import IncrementalDetokenizer


def test_streamed_emoji_and_cjk_come_out_whole(tiny_model_dir):
    from transformers import AutoTokenizer

    path, _ = tiny_model_dir("llama")
    tok = AutoTokenizer.from_pretrained(str(path))
    text = "Paris 😀 is 日本語 and 🇫🇷 café."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:", add_special_tokens=False))
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) < len(ids)  # some tokens were held back mid-character


def _python_only(tok, prompt, ids, skip_special_tokens=True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
    detok._stream = detok._rust = None  # the Python window throughout: the reference
    return [detok.add(t) for t in ids]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")[0]))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, 299), max_size=10),
    ids=st.lists(st.integers(0, 299), max_size=40),
    skip=st.booleans(),
)
def test_the_rust_stream_gives_the_python_windows_deltas(tok, prompt, ids, skip):
    """Random ids (special tokens, split characters, invalid UTF-8 included): the same
    deltas, token for token, as the Python window, or its text from where the stream
    refused a token (the rest of the request goes on in Python)."""
    detok = IncrementalDetokenizer(tok, prompt, skip)
    # A fast tokenizer: the Rust stream, unless the context ends inside a character.
    assert (detok._stream is None) == tok.decode(prompt[-6:], skip_special_tokens=skip).endswith("\ufffd")
    deltas = [detok.add(t) for t in ids]
    reference = _python_only(tok, prompt, ids, skip)
    if detok._rust is not None:  # (a stream that refuses a token drops it for good)
        assert deltas == reference
    else:  # the stream refused one: the text still adds up
        assert "".join(deltas) == "".join(reference)


def test_a_context_ending_inside_a_character_hands_over_to_rust_after_a_delta(tok):
    """Token-id prompts (random ones, as benchmarks send) often end inside a character:
    such a request starts in Python and goes on in Rust once a delta is out."""
    ids = tok.encode("日本語 and café, machine learning is fun.", add_special_tokens=False)
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    prompt, out = ids[:split], ids[split:]
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok._stream is None  # its context ends inside a character
    deltas = [detok.add(t) for t in out]
    assert deltas == _python_only(tok, prompt, out)
    assert "".join(deltas).endswith(" and café, machine learning is fun.")
    assert detok._stream is not None
    first = next(i for i, d in enumerate(deltas) if d)
    streamed = IncrementalDetokenizer(tok, prompt)
    for t in out[: first + 1]:
        streamed.add(t)
    assert streamed._stream is not None  # from the first delta on


def test_a_refusing_stream_hands_over_to_python_without_losing_text(tok):
    text = "Paris 😀 is 日本語 and café. Machine learning is fun."
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Prompt:", add_special_tokens=False)

    class Refusing:
        """The real stream until its ``refuse_at``-th token, which it refuses."""

        def __init__(self, real, refuse_at: int):
            self.real, self.refuse_at, self.calls = real, refuse_at, 0

        def step(self, rust, token_id):
            self.calls += 1
            if self.calls > self.refuse_at:
                raise Exception("Invalid prefix encountered")
            return self.real.step(rust, token_id)

    for refuse_at in range(len(ids)):
        detok = IncrementalDetokenizer(tok, prompt)
        detok._stream = refusing = Refusing(detok._stream, refuse_at)
        assert "".join(detok.add(t) for t in ids) == text, refuse_at
        assert detok._stream is None and refusing.calls == refuse_at + 1


def test_a_tokenizer_with_its_own_decoding_keeps_the_python_window(tok):
    class Cleaning(type(tok)):  # a subclass that decodes its own way
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs)

    tok.__class__, real = Cleaning, tok.__class__
    try:
        assert IncrementalDetokenizer(tok)._stream is None
    finally:
        tok.__class__ = real
    assert IncrementalDetokenizer(tok)._stream is not None


def test_the_text_is_the_tokens_text_whatever_space_clean_up_the_config_asks(tok):
    """transformers' space clean-up (" ," -> ","; a config may ask for it, and may force it
    on a BPE vocabulary, which transformers otherwise spares) is never applied: on a
    window it lost the comma whose space was already out (" It isn't here  is it"). So the
    Rust stream serves such tokenizers too, with the same deltas as the Python window."""
    text = " It is n't here , is it ? I 'm sure . Yes !"
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Prompt:", add_special_tokens=False)
    try:
        tok.clean_up_tokenization_spaces = True
        tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
        assert tok.decode(ids) == " It isn't here, is it? I'm sure. Yes!"  # (decode does clean up)
        detok = IncrementalDetokenizer(tok, prompt)
        assert detok._stream is not None
        deltas = [detok.add(t) for t in ids]
        assert deltas == _python_only(tok, prompt, ids) and "".join(deltas) == text
    finally:
        tok.clean_up_tokenization_spaces = False
        tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = False
