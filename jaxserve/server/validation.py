"""Turning a wire GenerateRequest into prompt token ids and SamplingParams, or a clear
error naming the field and what is allowed (answered as INVALID_ARGUMENT).

Sizes are checked before tokenizing (``server.max_prompt_chars``), then the server's caps:
``max_prompt_tokens`` and ``max_tokens_limit``. Runs on a worker thread, not the event loop.
"""

from __future__ import annotations

import dataclasses
import json

import jinja2
import numpy as np

from jaxserve.assembly import EngineHandle
from jaxserve.errors import RequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.config import ServerConfig
from jaxserve.server.proto import jaxserve_pb2 as pb

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID_LEN = 256
_DEFAULT_LIMITS = ServerConfig(metrics_port=None)


def _wire_float(x: float) -> float:
    """The float32 the client sent, as the shortest decimal that is that float32 (0.9, not
    0.8999999761581421): exact, where rounding to 6 places turned 1e-30 into 0."""
    return float(str(np.float32(x)))


# The wire's sampling fields are SamplingParams' own, by name (a test checks both ways):
# adding an option is a SamplingParams field plus its proto field, no list here.
_WIRE = pb.SamplingParams.DESCRIPTOR.fields_by_name


def _from_wire(msg: pb.SamplingParams) -> dict:
    """The fields the client set, as SamplingParams keyword arguments."""
    kwargs = {}
    for name in (f.name for f in dataclasses.fields(SamplingParams)):
        field = _WIRE[name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            kwargs[name] = tuple((k, _wire_float(v)) for k, v in getattr(msg, name).items())
        elif field.is_repeated:
            if getattr(msg, name):  # proto3: an empty list is one not set (choice: None)
                kwargs[name] = tuple(getattr(msg, name))
        elif msg.HasField(name):
            value = getattr(msg, name)
            kwargs[name] = _wire_float(value) if field.type == field.TYPE_FLOAT else value
    return kwargs


def sampling_params(
    msg: pb.SamplingParams, prompt_len: int, max_model_len: int, max_tokens_limit: int | None = None
) -> SamplingParams:
    return checked_params(_from_wire(msg), prompt_len, max_model_len, max_tokens_limit)


def checked_params(
    kwargs: dict,
    prompt_len: int,
    max_model_len: int,
    max_tokens_limit: int | None = None,
    default_max_tokens: int = 1024,
) -> SamplingParams:
    """SamplingParams(**kwargs) within the context and the server's cap; max_tokens, when
    not given, is ``default_max_tokens`` or the room left, whichever is less."""
    kwargs = dict(kwargs)
    room = max_model_len - prompt_len
    cap = room if max_tokens_limit is None else min(room, max_tokens_limit)
    max_tokens = kwargs.setdefault("max_tokens", min(cap, default_max_tokens))
    if max_tokens_limit is not None and isinstance(max_tokens, int) and max_tokens > max_tokens_limit:
        raise RequestError(
            f"sampling_params.max_tokens = {max_tokens}: this server allows at most {max_tokens_limit} "
            f"(server.max_tokens_limit)"
        )
    if isinstance(max_tokens, int) and max_tokens > room:
        raise RequestError(
            f"sampling_params.max_tokens = {max_tokens}: prompt ({prompt_len} tokens) + max_tokens must be "
            f"<= max_model_len ({max_model_len}); at most {room} here"
        )
    try:
        return SamplingParams(**kwargs)
    except TypeError as e:  # a bool where a number belongs and the like
        raise RequestError(f"sampling_params: {e}") from None


def chat_options(chat: pb.ChatMessages) -> dict:
    """How a chat ends and its template's variables (``EngineHandle.encode``'s options), from
    ChatMessages' fields."""
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    variables = None  # both flags and its names are checked with the messages (EngineHandle.encode)
    if chat.chat_template_kwargs:
        try:
            variables = json.loads(chat.chat_template_kwargs)
        except ValueError as e:
            raise RequestError(f"chat.chat_template_kwargs: not JSON ({e})") from None
        if not isinstance(variables, dict):
            raise RequestError("chat.chat_template_kwargs: a JSON object of the chat template's variables")
    return {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": chat.continue_final_message,
        "chat_template_kwargs": variables,
    }


def prompt_ids(
    msg: pb.GenerateRequest, handle: EngineHandle, max_chars: int = ServerConfig.max_prompt_chars
) -> list[int]:
    """Token ids of the request's prompt (text, token ids, or chat with the template), the
    last truncate_prompt_tokens of them if set."""
    truncate = msg.truncate_prompt_tokens if msg.HasField("truncate_prompt_tokens") else None
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise RequestError("prompt: one of text, token_ids or chat is required")
    if kind == "text":
        if not msg.text:
            raise RequestError("text: the prompt is empty")
        if len(msg.text) > max_chars:
            raise RequestError(f"text: {len(msg.text)} characters; at most {max_chars} (server.max_prompt_chars)")
        return handle.encode(msg.text, "text", truncate_prompt_tokens=truncate)
    if kind == "token_ids":
        if not msg.token_ids.ids:
            raise RequestError("token_ids: the prompt is empty")
        return handle.encode(list(msg.token_ids.ids), "token_ids.ids", truncate_prompt_tokens=truncate)
    messages = []
    if not msg.chat.messages:
        raise RequestError("chat.messages: at least one message is required")
    total = 0
    for i, m in enumerate(msg.chat.messages):
        if m.role not in CHAT_ROLES:
            role = m.role if len(m.role) <= 40 else f"{m.role[:40]}..."
            raise RequestError(f"chat.messages[{i}].role = {role!r}: must be one of {', '.join(CHAT_ROLES)}")
        total += len(m.content)
        messages.append({"role": m.role, "content": m.content})
        if total > max_chars:
            raise RequestError(f"chat.messages: over {max_chars} characters in all (server.max_prompt_chars)")
    try:
        return handle.encode(messages, "chat.messages", truncate_prompt_tokens=truncate, **chat_options(msg.chat))
    except jinja2.TemplateError as e:  # e.g. "roles must alternate user/assistant"
        raise RequestError(f"chat.messages: the model's chat template refuses them: {str(e)[:300]}") from None


def validate(
    msg: pb.GenerateRequest, handle: EngineHandle, limits: ServerConfig = _DEFAULT_LIMITS
) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids and the sampling parameters, within ``limits`` (the server's
    max_prompt_chars, max_prompt_tokens and max_tokens_limit)."""
    if len(msg.request_id) > MAX_REQUEST_ID_LEN:
        raise RequestError(f"request_id: {len(msg.request_id)} characters; at most {MAX_REQUEST_ID_LEN}")
    ids = prompt_ids(msg, handle, limits.max_prompt_chars)  # shorter than max_model_len
    if limits.max_prompt_tokens is not None and len(ids) > limits.max_prompt_tokens:
        raise RequestError(
            f"prompt: {len(ids)} tokens; this server allows at most {limits.max_prompt_tokens} "
            f"(server.max_prompt_tokens)"
        )
    params = sampling_params(msg.sampling_params, len(ids), handle.max_model_len, limits.max_tokens_limit)
    handle.engine.check_params(params)  # a schema or regex that cannot compile: here, not mid-step
    return ids, params
