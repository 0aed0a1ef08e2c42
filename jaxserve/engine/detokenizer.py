"""Incremental detokenization: UTF-8-safe text deltas from a growing list of token ids.

Decoding token by token breaks multi-byte characters (an emoji spans several byte-level
tokens). We decode a small window ``ids[prefix:]`` twice, with and without the newest
tokens, and emit the difference only once it no longer ends in U+FFFD (an incomplete
character).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])[-6:]  # a little context for spacing
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Appends one token; returns the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""
