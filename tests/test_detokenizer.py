from __future__ import annotations

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
