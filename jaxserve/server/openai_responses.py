"""OpenAI's Responses API answers (POST /v1/responses): the response object of one assistant
message, and for a stream the events that build it, in OpenAI's order (created, in
progress, the message and its text part opened, text deltas, each closed, completed).

A request's conversation runs as a chat (``RequestPreparer.response``); what differs from
/v1/chat/completions is only the shape of the answer, which is all this module holds.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from jaxserve.engine.async_engine import Delta
from jaxserve.server.openai_protocol import ResponsesRequest


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of an answer that ended for ``finish_reason``: cut at
    max_output_tokens (or the context's end) is OpenAI's "incomplete"."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def usage_of(final: Delta) -> dict:
    return {
        "input_tokens": final.prompt_tokens,
        "input_tokens_details": {"cached_tokens": final.cached_tokens},
        "output_tokens": final.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


class ResponseBuilder:
    """One response's objects: its head (what the request set), its message item and text
    part as they stand, and the events of a stream, numbered in order."""

    def __init__(self, body: ResponsesRequest, response_id: str, created: int, model: str):
        self.body = body
        self.id = response_id
        self.message_id = f"msg_{uuid.uuid4().hex[:24]}"
        self.created = created
        self.model = model
        self.sequence = 0
        self.where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}  # the text's place

    def response(self, text: str | None = None, final: Delta | None = None) -> dict:
        """The response object: in progress (no ``final`` delta yet, no output), or finished
        with ``text``."""
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        status, incomplete = ("in_progress", None) if final is None else status_of(final.finish_reason)
        output = [] if text is None else [self.message(status, text)]
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": False,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,  # nothing is kept (as vLLM without its store)
            "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": "none",
            "tools": [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": usage_of(final) if final is not None else None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": []}

    def message(self, status: str, text: str | None) -> dict:
        content = [] if text is None else [self.part(text)]
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": content}

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event of the stream, numbered: ``event:`` and ``data:`` lines,
        as OpenAI sends them (the client reads the type from either)."""
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def opening(self) -> list[str]:
        """The events before the first text: the response created and in progress, its
        message and the message's text part added."""
        return [
            self.event("response.created", response=self.response()),
            self.event("response.in_progress", response=self.response()),
            self.event("response.output_item.added", output_index=0, item=self.message("in_progress", None)),
            self.event("response.content_part.added", **self.where, part=self.part("")),
        ]

    def delta(self, text: str) -> str:
        return self.event("response.output_text.delta", **self.where, delta=text, logprobs=[])

    def closing(self, text: str, final: Delta) -> list[str]:
        """The events after the last text: the text, its part and the message done, then
        the response: always as response.completed, its status "incomplete" where the text
        was cut at max_output_tokens (as vLLM sends it; the openai client's stream helper
        waits for that event, and OpenAI's own response.incomplete left it without one)."""
        done = self.response(text, final)
        return [
            self.event("response.output_text.done", **self.where, text=text, logprobs=[]),
            self.event("response.content_part.done", **self.where, part=self.part(text)),
            self.event("response.output_item.done", output_index=0, item=done["output"][0]),
            self.event("response.completed", response=done),
        ]

    def error(self, message: str) -> str:
        """An error after the stream began (its status line has gone out)."""
        return self.event("error", code=None, message=message, param=None)
