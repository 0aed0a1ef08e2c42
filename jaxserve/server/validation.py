"""Turning a wire GenerateRequest into prompt token ids and SamplingParams, or a clear
error naming the field and what is allowed (answered as INVALID_ARGUMENT)."""

from __future__ import annotations

from jaxserve.errors import RequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.proto import jaxserve_pb2 as pb

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_PROMPT_CHARS = 1_000_000
MAX_REQUEST_ID_LEN = 256
_OPTIONAL = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "ignore_eos",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
)


def sampling_params(msg: pb.SamplingParams, prompt_len: int, max_model_len: int) -> SamplingParams:
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if name in kwargs:
            kwargs[name] = round(float(kwargs[name]), 6)  # float32 on the wire
    room = max_model_len - prompt_len
    max_tokens = kwargs.setdefault("max_tokens", min(room, 1024))
    if max_tokens > room:
        raise RequestError(
            f"sampling_params.max_tokens = {max_tokens}: prompt ({prompt_len} tokens) + max_tokens must be "
            f"<= max_model_len ({max_model_len}); at most {room} here"
        )
    kwargs["stop_token_ids"] = tuple(msg.stop_token_ids)
    kwargs["stop"] = tuple(msg.stop)
    try:
        return SamplingParams(**kwargs)
    except TypeError as e:  # a bool where a number belongs and the like
        raise RequestError(f"sampling_params: {e}") from None


def prompt_ids(msg: pb.GenerateRequest, llm) -> list[int]:
    """Token ids of the request's prompt (text, token ids, or chat with the template)."""
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise RequestError("prompt: one of text, token_ids or chat is required")
    if kind == "text":
        if not msg.text:
            raise RequestError("text: the prompt is empty")
        if len(msg.text) > MAX_PROMPT_CHARS:
            raise RequestError(f"text: {len(msg.text)} characters; at most {MAX_PROMPT_CHARS}")
        return llm.encode(msg.text)
    if kind == "token_ids":
        ids = list(msg.token_ids.ids)
        if not ids:
            raise RequestError("token_ids: the prompt is empty")
        vocab = llm.model_config.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise RequestError(f"token_ids.ids[{i}] = {t}: out of range; allowed 0..{vocab - 1}")
        return ids
    messages = []
    if not msg.chat.messages:
        raise RequestError("chat.messages: at least one message is required")
    total = 0
    for i, m in enumerate(msg.chat.messages):
        if m.role not in CHAT_ROLES:
            raise RequestError(f"chat.messages[{i}].role = {m.role!r}: must be one of {', '.join(CHAT_ROLES)}")
        total += len(m.content)
        messages.append({"role": m.role, "content": m.content})
    if total > MAX_PROMPT_CHARS:
        raise RequestError(f"chat.messages: {total} characters in all; at most {MAX_PROMPT_CHARS}")
    return llm.encode(messages)


def validate(msg: pb.GenerateRequest, llm) -> tuple[list[int], SamplingParams]:
    if len(msg.request_id) > MAX_REQUEST_ID_LEN:
        raise RequestError(f"request_id: {len(msg.request_id)} characters; at most {MAX_REQUEST_ID_LEN}")
    ids = prompt_ids(msg, llm)
    if len(ids) >= llm.max_model_len:
        raise RequestError(f"prompt: {len(ids)} tokens; must be shorter than max_model_len ({llm.max_model_len})")
    return ids, sampling_params(msg.sampling_params, len(ids), llm.max_model_len)
