"""An OpenAI request body as what the engine takes: prompt token ids and SamplingParams.

Runs on the HTTP API's worker threads (tokenizing and compiling a structured-output
constraint take milliseconds to seconds, not the event loop's time). Checks the server's
prompt limits, renders chats through the model's template as vLLM does, maps OpenAI's and
vLLM's sampling fields onto SamplingParams, and refuses by name what is not served: every
error is an ``APIError`` naming the field the client sent.
"""

from __future__ import annotations

import json
from typing import Any

import jinja2

from jaxserve.assembly import EngineHandle
from jaxserve.errors import RequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.config import ServerConfig
from jaxserve.server.openai_protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    RESPONSES_REFUSED,
    APIError,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    ResponsesRequest,
    SamplingCore,
    SamplingFields,
    TokenizeRequest,
    bad_request,
)
from jaxserve.server.validation import CHAT_ROLES, checked_params

# A chat without max_tokens: this many, or the context's room left if less (gRPC's default too).
CHAT_DEFAULT_MAX_TOKENS = 1024


class RequestPreparer:
    """Turns request bodies into (prompt ids, SamplingParams) within ``limits``."""

    def __init__(self, handle: EngineHandle, limits: ServerConfig):
        self.handle = handle
        self.limits = limits

    def completion(self, body: CompletionRequest) -> list[tuple[list[int], SamplingParams, str]]:
        """(prompt ids, params, echoed text) per prompt."""
        _refuse_vllm_only(body)
        if body.suffix:
            raise APIError(400, "suffix: not supported by this server", param="suffix")
        if body.echo and body.logprobs is not None and body.stream:
            raise APIError(
                400,
                "echo: with logprobs, not available with stream = true (the prompt's logprobs come with the "
                "whole response)",
                param="echo",
            )
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt: at least one prompt is required", param="prompt")
        kwargs, renames = self._sampling_kwargs(body)
        if body.logprobs is not None:
            kwargs["logprobs"] = body.logprobs
            if body.echo:  # as vLLM: the echoed prompt's tokens get logprobs too (eval harnesses' loglikelihood)
                kwargs.setdefault("prompt_logprobs", body.logprobs)
        self._ready_token_texts(kwargs)
        if body.max_tokens is not None:
            kwargs["max_tokens"] = body.max_tokens
        truncate = body.truncate_prompt_tokens
        out = []
        for i, p in enumerate(prompts):
            field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            ids = self.encode(p, field, truncate)
            whole = isinstance(p, str) and truncate is None  # else what was computed: the ids' text
            echo = (p if whole else self.handle.tokenizer.decode(ids)) if body.echo else ""
            out.append((ids, self._params(kwargs, len(ids), COMPLETION_DEFAULT_MAX_TOKENS, renames), echo))
        return out

    def chat(self, body: ChatRequest) -> tuple[list[int], SamplingParams]:
        """(prompt ids, params): the chat rendered by the model's template (``chat_ids``)."""
        _refuse_vllm_only(body)
        if body.tools:
            raise APIError(400, "tools: tool calling is not supported by this server", param="tools")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: only with logprobs = true", param="top_logprobs")
        ids = self.chat_ids(body, body.truncate_prompt_tokens)
        kwargs, renames = self._sampling_kwargs(body)
        if body.logprobs:
            kwargs["logprobs"] = body.top_logprobs or 0
            if body.top_logprobs is not None:
                renames["logprobs"] = "top_logprobs"
        self._ready_token_texts(kwargs)
        if body.max_completion_tokens is not None:
            kwargs["max_tokens"] = body.max_completion_tokens
            renames["max_tokens"] = "max_completion_tokens"
        elif body.max_tokens is not None:
            kwargs["max_tokens"] = body.max_tokens
        return ids, self._params(kwargs, len(ids), CHAT_DEFAULT_MAX_TOKENS, renames)

    def chat_ids(self, body: ChatRequest | TokenizeRequest, truncate: int | None = None) -> list[int]:
        """A chat's token ids as vLLM renders it: the assistant's header after the last
        message (add_generation_prompt, the default); nothing after it, the turn closed
        (add_generation_prompt = false); or the last message left open for the model to go
        on with (continue_final_message: an assistant prefill, "Sure, here is the JSON: {");
        chat_template_kwargs: more of the template's variables."""
        return self.encode(
            self._messages(body.messages),
            "messages",
            truncate,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template_kwargs=body.chat_template_kwargs,
        )

    def encode(self, prompt, field: str, truncate: int | None = None, **chat) -> list[int]:
        """Token ids of a text, id list or chat (``chat``: how it ends, ``EngineHandle.encode``),
        within the server's prompt limits; ``truncate``: vLLM's truncate_prompt_tokens (the
        limits on tokens apply to what it keeps)."""
        limits = self.limits
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, f"{field}: the prompt is empty", param=field)
            if len(prompt) > limits.max_prompt_chars:
                raise APIError(
                    400,
                    f"{field}: {len(prompt)} characters; at most {limits.max_prompt_chars} (server.max_prompt_chars)",
                    param=field,
                )
        elif not prompt:
            raise APIError(400, f"{field}: the prompt is empty", param=field)
        try:
            ids = self.handle.encode(prompt, field, truncate_prompt_tokens=truncate, **chat)
        except jinja2.TemplateError as e:
            raise APIError(
                400, f"{field}: the model's chat template refuses them: {str(e)[:300]}", param=field
            ) from None
        except RequestError as e:
            raise bad_request(e) from None
        if limits.max_prompt_tokens is not None and len(ids) > limits.max_prompt_tokens:
            raise APIError(
                400,
                f"{field}: {len(ids)} tokens; this server allows at most {limits.max_prompt_tokens} "
                f"(server.max_prompt_tokens)",
                param=field,
            )
        return ids

    def _messages(self, messages: list, field: str = "messages", text_parts: tuple[str, ...] = ("text",)) -> list[dict]:
        """Chat messages (``role``, ``content``: a text or parts of the ``text_parts`` types)
        as the template takes them; errors name ``field[i]``."""
        out, total = [], 0
        for i, m in enumerate(messages):
            role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for system
            if role not in CHAT_ROLES:
                shown = m.role if len(m.role) <= 40 else f"{m.role[:40]}..."
                raise APIError(
                    400,
                    f"{field}[{i}].role = {shown!r}: must be one of {', '.join(CHAT_ROLES)}, developer",
                    param=f"{field}[{i}].role",
                )
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.type not in text_parts or part.text is None:
                        raise APIError(
                            400,
                            f"{field}[{i}].content[{j}].type = {part.type!r}: only text parts are served "
                            f"({', '.join(text_parts)})",
                            param=f"{field}[{i}].content[{j}].type",
                        )
                content = "".join(part.text for part in m.content)
            else:
                content = m.content or ""
            total += len(content)
            if total > self.limits.max_prompt_chars:
                raise APIError(
                    400,
                    f"{field}: over {self.limits.max_prompt_chars} characters in all (server.max_prompt_chars)",
                    param=field,
                )
            out.append({"role": role, "content": content})
        return out

    def response(self, body: ResponsesRequest) -> tuple[list[int], SamplingParams]:
        """(prompt ids, params) of a Responses API request: ``instructions`` as a system
        message before ``input``'s messages, rendered as a chat; ``text.format`` as
        response_format; the rest as on /v1/chat/completions."""
        for name, why in RESPONSES_REFUSED.items():
            if getattr(body, name):  # set to ask for something: false, 0, [] and {} ask for nothing
                raise APIError(400, f"{name}: {why}", param=name)
        if body.truncation not in (None, "disabled"):
            raise APIError(
                400,
                f"truncation = {body.truncation!r}: only 'disabled' (a conversation longer than the context is "
                "refused, not cut)",
                param="truncation",
            )
        if isinstance(body.input, str):
            items = [ChatMessage(role="user", content=body.input)]
        else:
            items = []
            for i, item in enumerate(body.input):
                if item.type != "message" or item.role is None:
                    raise APIError(
                        400,
                        f"input[{i}].type = {item.type!r}: only messages (with a role) are served",
                        param=f"input[{i}].type",
                    )
                items.append(ChatMessage(role=item.role, content=item.content))
        if body.instructions is not None:
            items.insert(0, ChatMessage(role="system", content=body.instructions))
        field = "input"
        messages = self._messages(items, field, ("input_text", "output_text", "text"))
        ids = self.encode(messages, field)
        kwargs = _core_kwargs(body)
        renames = {"max_tokens": "max_output_tokens"}
        fmt = body.text.format if body.text is not None else None
        if fmt is not None and fmt.type != "text":
            kwargs.update(_format_constraint(fmt.type, fmt.schema_, "text.format", "text.format.schema"))
            renames.update({"json_object": "text.format", "json_schema": "text.format.schema"})
        if body.max_output_tokens is not None:
            kwargs["max_tokens"] = body.max_output_tokens
        return ids, self._params(kwargs, len(ids), CHAT_DEFAULT_MAX_TOKENS, renames)

    def _sampling_kwargs(self, body: SamplingFields) -> tuple[dict, dict[str, str]]:
        """(SamplingParams keyword arguments of the shared fields, renames: our field names
        to the request's, for errors); refuses by name what is not served."""
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, f"best_of = {body.best_of}: only best_of == n is served", param="best_of")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options: only with stream = true", param="stream_options")
        if body.prompt_logprobs is not None and body.stream:  # as vLLM: they come with the whole response
            raise APIError(400, "prompt_logprobs: not available with stream = true", param="prompt_logprobs")
        kwargs = _core_kwargs(body)
        kwargs.update(n=body.n, include_stop_str_in_output=body.include_stop_str_in_output)
        if body.prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = body.prompt_logprobs
        if body.stop is not None:
            kwargs["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
        if body.stop_token_ids:
            kwargs["stop_token_ids"] = tuple(body.stop_token_ids)
        field, constraint = structured_constraint(body)
        kwargs.update(constraint)
        # Errors about the constraint name the field the client used.
        renames = {f"{key}": field for key in constraint if field != key}
        return kwargs, renames

    def _params(self, kwargs: dict, prompt_len: int, default_max_tokens: int, renames=None) -> SamplingParams:
        """Within the server's limits, its constraint (if any) compiled: on the worker."""
        try:
            params = checked_params(
                kwargs, prompt_len, self.handle.max_model_len, self.limits.max_tokens_limit, default_max_tokens
            )
            self.handle.engine.check_params(params)
            return params
        except RequestError as e:
            raise bad_request(e, renames) from None

    def _ready_token_texts(self, kwargs: dict) -> None:
        """With logprobs asked for: the tokenizer's byte view built now, on the worker pool
        (~0.3 s once), not on the event loop when the first token's text is wanted."""
        if kwargs.get("logprobs") is not None or kwargs.get("prompt_logprobs") is not None:
            self.handle.token_bytes(0)


def structured_constraint(body: SamplingFields) -> tuple[str, dict]:
    """(the request's field, SamplingParams keyword) of its structured-output constraint:
    OpenAI's response_format, or vLLM's guided_* / structured_outputs."""
    found = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        schema = rf.json_schema.get("schema") if isinstance(rf.json_schema, dict) else None
        found.append(
            (
                "response_format",
                _format_constraint(rf.type, schema, "response_format", "response_format.json_schema.schema"),
            )
        )
    so = body.structured_outputs if isinstance(body.structured_outputs, dict) else {}
    if body.structured_outputs is not None and not isinstance(body.structured_outputs, dict):
        raise APIError(400, "structured_outputs: must be an object", param="structured_outputs")
    for field, value, key in (
        ("guided_json", body.guided_json, "json_schema"),
        ("guided_regex", body.guided_regex, "regex"),
        ("guided_choice", body.guided_choice, "choice"),
        ("guided_grammar", body.guided_grammar, "grammar"),
        ("structured_outputs.json", so.get("json"), "json_schema"),
        ("structured_outputs.regex", so.get("regex"), "regex"),
        ("structured_outputs.choice", so.get("choice"), "choice"),
        ("structured_outputs.grammar", so.get("grammar"), "grammar"),
    ):
        if value is None:
            continue
        if key == "json_schema" and not isinstance(value, str):
            value = json.dumps(value)
        elif key == "choice":
            if not isinstance(value, list) or not value:
                raise APIError(400, f"{field}: must be a non-empty list of strings", param=field)
            value = tuple(value)
        found.append((field, {key: value}))
    if len(found) > 1:
        raise APIError(
            400,
            f"{found[1][0]}: only one structured-output constraint, {found[0][0]} is set too",
            param=found[1][0],
        )
    return found[0] if found else ("", {})


def _format_constraint(kind: str, schema: Any, field: str, schema_field: str) -> dict[str, Any]:
    """The constraint of an OpenAI output format other than text (chat's ``response_format``,
    the Responses API's ``text.format``): ``kind`` json_object or json_schema, ``schema``
    the latter's; errors name ``field``.type and ``schema_field``."""
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise APIError(
            400, f"{field}.type = {kind!r}: must be one of text, json_object, json_schema", param=f"{field}.type"
        )
    if not isinstance(schema, dict | bool):
        raise APIError(400, f"{schema_field}: a JSON schema (an object) is required", param=schema_field)
    return {"json_schema": json.dumps(schema)}


def _core_kwargs(body: SamplingCore) -> dict[str, Any]:
    """SamplingParams keyword arguments of the fields every generating endpoint takes."""
    kwargs: dict[str, Any] = dict(
        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, skip_special_tokens=body.skip_special_tokens
    )
    # As given (vLLM's top_k = -1 too: SamplingParams takes it as no top-k).
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "min_p",
                 "repetition_penalty"):  # fmt: skip
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    if body.logit_bias:
        try:  # OpenAI's keys are token ids as strings
            kwargs["logit_bias"] = tuple((int(k), v) for k, v in body.logit_bias.items())
        except ValueError:
            raise APIError(400, "logit_bias: keys must be token ids", param="logit_bias") from None
    return kwargs


def _refuse_vllm_only(body: CompletionRequest | ChatRequest) -> None:
    """One 400 for a vLLM field this server would otherwise drop (``VLLM_ONLY``)."""
    refused = body.vllm_only()
    if refused is not None:
        raise APIError(400, refused[1], param=refused[0])
