"""The OpenAI API's wire types: its request bodies as pydantic models, and its error.

Bodies ignore unknown fields, as vLLM's server does (each name logged once; OpenAI's own
API refuses them), take null for an optional field as its default, and are strict about
types (``true`` is not token id 1). Every refusal is an ``APIError``: a status, OpenAI's
error type and the field at fault (``param``), which ``openai_api.py`` answers with
OpenAI's error body.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import types
from collections.abc import Callable
from typing import Any, Union, get_args, get_origin

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler, field_validator, model_validator

from jaxserve.errors import RequestError

logger = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MAX_ERROR_CHARS = 1000
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    409: "invalid_request_error",  # the request id is in use: the caller's to change
    413: "invalid_request_error",
}


class APIError(Exception):
    """An answer other than 200: status, OpenAI error type, message, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict:
        """OpenAI's error body (a stream's error event carries the same)."""
        message = self.message
        if len(message) > MAX_ERROR_CHARS:
            message = f"{message[:MAX_ERROR_CHARS]}... (cut at {MAX_ERROR_CHARS} characters)"
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(e: RequestError, renames: dict[str, str] | None = None) -> APIError:
    """A RequestError as a 400 naming its field: "sampling_params.top_p = 1.5: ..." is
    the request's ``top_p``."""
    message = str(e).replace("sampling_params.", "")
    for ours, theirs in (renames or {}).items():
        message = re.sub(rf"^{ours}\b", theirs, message)
    m = re.match(r"[A-Za-z_][\w.]*(\[\d+\])?[\w.]*", message)
    return APIError(400, message, param=m.group(0) if m else None)


def validation_error(errors: list[dict]) -> APIError:
    """pydantic's errors for a body as one 400 naming the first field at fault, in our
    own errors' style (messages[0].content, not messages.0.content)."""
    first = errors[0] if errors else {}
    field, member = _union_field(first.get("loc", ()))
    param = "".join(f"[{x}]" if x.isdigit() else f".{x}" for x in field).lstrip(".") or None
    if first.get("type") == "json_invalid":
        # The parser's reason and where: "trailing comma at line 1 column 15", or "recursion
        # limit exceeded ..." for JSON nested deeper than the parser's limit (a schema too).
        reason = (first.get("ctx") or {}).get("error")
        message, param = f"the body is not valid JSON: {reason}" if reason else "the body is not valid JSON", None
    elif member is not None:  # a union (prompt: str | list[int] | ...) none of whose members took it
        # A member of our own request types reads as what the client sends: an object
        # (content: "list[object]", not pydantic's "list[ContentPart]").
        members = dict.fromkeys(
            re.sub(r"\b[A-Z]\w*", "object", m) for f, m in (_union_field(err["loc"]) for err in errors) if f == field
        )
        message = f"{param}: must be one of {', '.join(members)}"
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid')}"
    return APIError(400, message, param=param)


# --- request bodies (unknown fields are ignored, as vLLM's server does) ---------------

# A union member's tag in a pydantic error's path: "prompt.list[int].0" (prompt as token ids).
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\])$")


def _union_field(loc) -> tuple[tuple[str, ...], str | None]:
    """(the path before the first union member's tag, the tag) of an error's ``loc``."""
    path = [str(x) for x in loc if x != "body"]
    at = next((i for i, x in enumerate(path) if _UNION_MEMBER.match(x)), len(path))
    return tuple(path[:at]), path[at] if at < len(path) else None


class _Body(BaseModel):
    # Strict types, as OpenAI's own API: pydantic's lax mode took true as token id 1,
    # "5" as 5 and max_tokens = true as 1. An int is still a number.
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's API takes null for every optional field as its default (clients send
        "n": null, "stream": null, "logprobs": null); a field that cannot be None then
        takes its default. A required field's null stays an error."""
        if isinstance(data, dict):
            defaulted = _not_nullable_with_default(cls)
            data = {k: v for k, v in data.items() if v is not None or k not in defaulted}
            _log_unknown(cls, data)
        return data


_LOGGED_UNKNOWN: set[tuple[str, str]] = set()


def _log_unknown(model: type[BaseModel], data: dict) -> None:
    """Logs a field that ``model`` does not know, once per name (as vLLM's server warns of
    the fields it ignored: a misspelt option is otherwise silently without effect), at most
    256 names: a client sending random keys cannot grow the set without bound."""
    known = _known_keys(model)
    for key in data:
        if key not in known and len(_LOGGED_UNKNOWN) < 256 and (model.__name__, key) not in _LOGGED_UNKNOWN:
            _LOGGED_UNKNOWN.add((model.__name__, key))
            logger.warning("a request's %s has a field this server ignores: %.80r (logged once)", model.__name__, key)


@functools.cache
def _known_keys(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(k for name, f in model.model_fields.items() for k in (name, f.alias) if k)


@functools.cache
def _not_nullable_with_default(model: type[BaseModel]) -> frozenset[str]:
    def nullable(annotation) -> bool:
        return annotation is Any or (
            get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)
        )

    fields = model.model_fields.items()
    return frozenset(name for name, f in fields if not f.is_required() and not nullable(f.annotation))


def _unset(value: Any) -> bool:
    return value is None


# vLLM request fields that this server does not implement, each with the test that a value
# asks for nothing (vLLM's default) and what stands for it here. An unknown field is dropped
# (vLLM drops what it does not know too); these would be dropped while the client counts on
# them (allowed_token_ids unconstrained, a cache_salt's isolation absent), so any other value
# is a 400 naming the field.
VLLM_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "allowed_token_ids": (
        _unset,
        "logit_bias, or a structured output (guided_choice, guided_regex), limits the tokens",
    ),
    "bad_words": (lambda v: not v, "logit_bias of -100 bans a token"),
    "use_beam_search": (lambda v: not v, "no beam search; n samples with best_of keep the likeliest"),
    "length_penalty": (lambda v: v is None or v == 1, "it weighs beam search's candidates, and there is none"),
    "cache_salt": (
        _unset,
        "the prefix cache is shared by every request (the server's enable_prefix_caching: false turns it off)",
    ),
    "return_tokens_as_token_ids": (
        lambda v: not v,
        "logprobs name tokens by their text; return_token_ids gives the ids",
    ),
    "logprob_token_ids": (_unset, "logprobs / top_logprobs give the likeliest tokens' logprobs"),
    "spaces_between_special_tokens": (lambda v: v is None or v is True, "text is decoded as the tokenizer decodes"),
    "truncation_side": (lambda v: v in (None, "left"), "truncate_prompt_tokens keeps a prompt's last tokens (left)"),
    "priority": (lambda v: v in (None, 0), "requests are served first come, first served"),
    "thinking_token_budget": (_unset, "max_tokens bounds the whole output"),
    "prompt_embeds": (_unset, "prompts are text or token ids"),
    "chat_template": (_unset, "the model's own template renders chats (chat_template_kwargs sets its variables)"),
    "documents": (_unset, "put the documents in the messages"),
    "echo": (lambda v: not v, "a chat's echo is not done; /v1/completions' echo is"),
}


def _vllm_only() -> Any:
    """A field of VLLM_ONLY's: None unless sent, checked by ``SamplingFields.vllm_only``."""
    return Field(default=None, json_schema_extra={"vllm_only": True})


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's counts so far.
    continuous_usage_stats: bool = False


class ResponseFormat(_Body):
    type: str = "text"
    json_schema: Any = None  # {"name": ..., "schema": {...}, "strict": ...}


class SamplingCore(_Body):
    """The sampling fields every generating endpoint takes: OpenAI's, then vLLM's extras."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True


class SamplingFields(SamplingCore):
    """The fields /v1/completions and /v1/chat/completions share: OpenAI's, then vLLM's."""

    n: int = 1
    stop: str | list[str] | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    best_of: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # Structured output by vLLM's names (OpenAI's is response_format).
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: Any = None
    prompt_logprobs: int | None = None
    # vLLM's: only the prompt's last k tokens are computed (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = None
    # vLLM's: the prompt's and each choice's token ids beside their text (RL trainers read them).
    return_token_ids: bool = False
    # vLLM's fields this server does not implement (VLLM_ONLY): read so that a value other
    # than vLLM's default is refused by name, not dropped as an unknown field would be.
    allowed_token_ids: Any = _vllm_only()
    bad_words: Any = _vllm_only()
    use_beam_search: Any = _vllm_only()
    length_penalty: Any = _vllm_only()
    cache_salt: Any = _vllm_only()
    return_tokens_as_token_ids: Any = _vllm_only()
    logprob_token_ids: Any = _vllm_only()
    spaces_between_special_tokens: Any = _vllm_only()
    truncation_side: Any = _vllm_only()
    priority: Any = _vllm_only()
    thinking_token_budget: Any = _vllm_only()

    def vllm_only(self) -> tuple[str, str] | None:
        """(field, refusal) for the first vLLM field set to what this server does not do."""
        for name, field in type(self).model_fields.items():
            if not (field.json_schema_extra or {}).get("vllm_only"):
                continue
            is_default, why = VLLM_ONLY[name]
            value = getattr(self, name)
            if not is_default(value):
                shown = json.dumps(value)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                return name, f"{name} = {shown}: vLLM's field, which this server does not implement; {why}"
        return None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = COMPLETION_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_embeds: Any = _vllm_only()

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_member(cls, value: Any, union: ValidatorFunctionWrapHandler) -> Any:
        """A prompt that is plainly one member as it is; the union's own validation (and its
        errors) for the rest. pydantic tries every member, and a member's errors are one per
        element: 5M token ids took 1.9 s against 0.3 as list[int] alone (one GIL-holding call:
        every stream waits for it)."""
        return value if _plain_prompt(value) else union(value)


def _plain_prompt(value: Any) -> bool:
    """A str, or a list of ints (not bools), of strs or of lists of ints: exactly one member."""
    if type(value) is str:
        return True
    if type(value) is not list:
        return False
    return (
        all(type(x) is int for x in value)
        or all(type(x) is str for x in value)
        or all(type(x) is list and all(type(y) is int for y in x) for x in value)
    )


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True  # vLLM's: the assistant's header after the last message
    continue_final_message: bool = False  # vLLM's: the last message left open (an assistant prefill)
    # vLLM's: more variables for the chat template (Qwen3's {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: Any = _vllm_only()
    documents: Any = _vllm_only()
    echo: Any = _vllm_only()  # a chat's (a completion's echo is its own field)


class ResponseInputItem(_Body):
    """An item of a Responses API ``input``: a message (the only kind served), its content a
    text or parts (``input_text``; an assistant's ``output_text``)."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None


class ResponseTextFormat(_Body):
    type: str = "text"  # text | json_object | json_schema
    name: str | None = None
    schema_: Any = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseTextConfig(_Body):
    format: ResponseTextFormat | None = None


class ResponsesRequest(SamplingCore):
    """OpenAI's Responses API (POST /v1/responses) as far as it is served: a conversation
    (``input`` after ``instructions``) answered by one assistant message, in text or a
    structured format (``text.format``); vLLM's sampling extras as on the other endpoints.
    The rest is refused by name (``RESPONSES_REFUSED``), but for fields that ask for nothing
    more here (``tool_choice``, ``parallel_tool_calls``, ``service_tier``, ...), dropped as
    unknown fields are."""

    input: str | list[ResponseInputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: ResponseTextConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool = True  # OpenAI's default; nothing is kept here (as vLLM without its store)
    truncation: str | None = None  # "disabled" (OpenAI's default) only
    # Refused unless unset, false, 0 or empty (RESPONSES_REFUSED):
    tools: list[Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: list[Any] | None = None
    reasoning: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None


# Responses API fields that ask for what this server does not do, and why: a set value is a
# 400 naming the field (dropped, each would change the answer or its meaning unannounced).
RESPONSES_REFUSED = {
    "tools": "tool calling is not supported by this server",
    "previous_response_id": "this server keeps no responses: send the whole conversation in input",
    "conversation": "this server keeps no conversations: send the whole conversation in input",
    "background": "responses are answered in the request (background runs need a store this server does not keep)",
    "include": "no extra output items are served (reasoning, logprobs, tool results)",
    "reasoning": "this server runs no reasoning models' options (chat templates' switches: /v1/chat/completions' "
    "chat_template_kwargs)",
    "prompt": "stored prompt templates are not served: send the text in input",
    "top_logprobs": "logprobs are served by /v1/chat/completions and /v1/completions",
    "max_tool_calls": "tool calling is not supported by this server",
}


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
