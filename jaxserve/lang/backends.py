"""Where a program's calls go: the offline engine (``LLMBackend``) or a running server
over gRPC (``Endpoint``). Both tokenize on this side, with the model's own tokenizer, so a
program builds the same token ids against either and gets the same greedy outputs.

A backend's calls: ``encode`` (a text segment's ids, no special tokens: a program's
prompt is its segments' ids one after the other, so a shared segment has the same ids in
every run; only the program's first text starts with what the tokenizer puts before a
text, a BOS, as a prompt of text does), ``roles`` (the chat template's text around each
role's content), ``submit`` (a request, not waited for) and ``result`` (its outcome,
waited for), ``unpin``.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from collections.abc import Callable
from typing import Any

from jaxserve.errors import JaxServeError, check_text
from jaxserve.sampling_params import SamplingParams

ROLES = ("system", "user", "assistant")
_MARK = "JAXSERVE_CONTENT_MARK"


class ProgramError(JaxServeError):
    """A program that cannot run as written (an unknown variable, a bad append, ...)."""


@dataclasses.dataclass
class Outcome:
    """What one call produced: the ids to append to the program's prompt and their text."""

    token_ids: list[int]
    text: str
    finish_reason: str
    lease_id: str | None = None
    pin_refused: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[float | None] | None = None  # when asked (select's scoring)


def role_markers(tokenizer) -> dict[str, tuple[str, str]]:
    """(text before, text after) a message's content, per role, from the chat template:
    each role rendered after the ones a conversation needs before it, minus those. Empty
    when the tokenizer has no chat template (role blocks are then an error)."""
    if not getattr(tokenizer, "chat_template", None):
        return {}

    def render(messages) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False)

    out = {}
    try:
        before = {
            "system": [],
            "user": [{"role": "system", "content": "S"}],
            "assistant": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        }
        for role in ROLES:
            head = render(before[role]) if before[role] else ""
            text = render([*before[role], {"role": role, "content": _MARK}])
            if not text.startswith(head) or text.count(_MARK) != 1:
                continue
            begin, end = text[len(head) :].split(_MARK)
            out[role] = (begin, end)
    except Exception:  # noqa: BLE001 - a template that refuses these probes: no role blocks
        return {}
    return out


def _outcome(token_ids: list[int], text: str, finish_reason: str, stop_reason, encode) -> list[int]:
    """The ids a finished call adds to the prompt: the sampled ids without a final stop
    token; after a stop string (the text was cut inside the ids) the text's own ids."""
    if isinstance(stop_reason, str):
        return encode(text)
    if finish_reason == "stop" and token_ids and stop_reason is not None:
        return token_ids[:-1]
    return list(token_ids)


class Backend:
    tokenizer: Any

    def encode(self, text: str, first: bool = False) -> list[int]:
        """``first``: the program's first text, which starts with the tokenizer's leading
        special tokens (Llama's or Mistral's BOS), as a prompt of text does in
        ``LLM.generate`` and on the servers, unless it holds them already (a chat
        template's BOS, rendered by a role block)."""
        check_text(text, "the program's text")
        if not text:
            return []
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        lead = self._leading_ids
        return lead + ids if first and ids[: len(lead)] != lead else ids

    @functools.cached_property
    def _leading_ids(self) -> list[int]:
        """What the tokenizer puts before a text of its own accord: [BOS], or nothing (an
        EOS it may put after is not a prompt's)."""
        plain, full = self.tokenizer.encode("a", add_special_tokens=False), self.tokenizer.encode("a")
        at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        return full[:at]

    @property
    def roles(self) -> dict[str, tuple[str, str]]:
        if not hasattr(self, "_roles"):
            self._roles = role_markers(self.tokenizer)
        return self._roles

    def submit(self, token_ids: list[int], params: SamplingParams, pin_s: float | None = None,
               on_text: Callable[[str], None] | None = None) -> Any:  # fmt: skip
        raise NotImplementedError

    def result(self, handle: Any) -> Outcome:
        raise NotImplementedError

    def cancel(self, handle: Any) -> None:
        """Aborts a submitted call whose result nobody will read."""
        raise NotImplementedError

    def _emit(self, handle: Any, on_text: Callable[[str], None], text: str) -> None:
        """Hands a call's text to its reader; a reader gone (a stream closed raises here)
        takes the call with it."""
        try:
            on_text(text)
        except BaseException:
            self.cancel(handle)
            raise

    def unpin(self, lease_id: str) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LLMBackend(Backend):
    """An offline ``LLM``, stepped by an engine thread of its own while the backend is open,
    so that many runs (threads) can submit at once and share its batches."""

    def __init__(self, llm):
        from jaxserve.engine.async_engine import EngineThread

        self.llm = llm
        self.tokenizer = llm.tokenizer
        self._thread = EngineThread(llm.engine, max_waiting_requests=1 << 30)
        self._thread.start()
        self._thread.wait_ready()

    def submit(self, token_ids, params, pin_s=None, on_text=None):
        if len(token_ids) >= self.llm.max_model_len:
            raise ProgramError(
                f"the program's prompt is {len(token_ids)} tokens; max_model_len is {self.llm.max_model_len}"
            )
        request_id = f"lang-{uuid.uuid4().hex}"
        sub = self._thread.submit_threadsafe(request_id, list(token_ids), params, enforce_limit=False, pin_s=pin_s)
        return sub, on_text, request_id

    def cancel(self, handle) -> None:
        self._thread.abort(handle[2])  # queued behind its add, if the engine has not taken it yet

    def result(self, handle) -> Outcome:
        sub, on_text, _ = handle
        while True:
            delta = sub.deltas.get()
            if delta.error is not None:
                raise ProgramError(f"the engine failed the call: {delta.error}")
            if on_text is not None and delta.text:
                self._emit(handle, on_text, delta.text)
            if delta.finish_reason is not None:
                break
        r = sub.request
        ids = _outcome(r.output_token_ids, r.output_text, r.finish_reason, r.stop_reason, self.encode)
        prompt_lp = list(r.prompt_logprobs) if r.params.prompt_logprobs is not None else None
        return Outcome(ids, r.output_text, r.finish_reason, r.lease_id, r.pin_refused, r.num_prompt_tokens,
                       r.num_cached_tokens, prompt_lp)  # fmt: skip

    def unpin(self, lease_id: str) -> bool:
        return bool(self._thread.call(lambda engine: engine.unpin(lease_id)))

    def stats(self) -> dict[str, int]:
        return dict(self._thread.call(lambda engine: engine.stats()))

    def close(self) -> None:
        self._thread.stop()


class Endpoint(Backend):
    """A running ``jaxserve run`` server at ``address``. The tokenizer is the server's model
    loaded here (``model``: an alias, directory or .gguf; default: the one the server
    names), so prompts travel as token ids."""

    def __init__(self, address: str, model: str | None = None, credentials=None):
        from jaxserve.client import Client

        self.client = Client(address, credentials)
        if model is None:
            import grpc

            try:
                model = self.client.model_info(timeout=60).model
            except grpc.RpcError as e:
                self.client.close()
                raise ProgramError(
                    f"Endpoint({address!r}): the jaxserve gRPC API does not answer ({e.code().name}: {e.details()})"
                ) from None
        self.tokenizer = _load_tokenizer(model)

    def submit(self, token_ids, params, pin_s=None, on_text=None):
        from jaxserve.client import build_request

        fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)}
        fields = {k: v for k, v in fields.items() if v != getattr(_DEFAULTS, k)}  # the server's defaults
        fields.setdefault("max_tokens", params.max_tokens)
        request = build_request(list(token_ids), pin_s=pin_s, **fields)
        if on_text is None:
            return self.client.stub.Generate.future(request, metadata=self.client._md), None
        return self.client.stub.StreamGenerate(request, metadata=self.client._md), on_text

    def cancel(self, handle) -> None:
        handle[0].cancel()  # the server aborts a cancelled call

    def result(self, handle) -> Outcome:
        import grpc

        from jaxserve.server.proto import jaxserve_pb2 as pb

        call, on_text = handle
        try:
            if on_text is None:
                msg = call.result()
                ids, text, last = list(msg.token_ids), msg.text, msg
            else:
                ids, pieces = [], []  # joined once: adding each piece copies the text so far
                for last in call:
                    ids += last.token_ids
                    pieces.append(last.text)
                    if last.text:
                        self._emit(handle, on_text, last.text)
                text = "".join(pieces)
        except grpc.RpcError as e:
            raise ProgramError(f"the server refused the call: {e.code().name}: {e.details()}") from None
        finish = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}.get(last.finish_reason, "abort")
        kind = last.WhichOneof("stop_reason")
        stop_reason = getattr(last, kind) if kind else None
        prompt_lp = [None if lp != lp else lp for lp in last.prompt_logprobs] or None  # NaN: none
        return Outcome(_outcome(ids, text, finish, stop_reason, self.encode), text, finish, last.lease_id or None,
                       last.pin_refused, last.usage.prompt_tokens, last.usage.cached_tokens, prompt_lp)  # fmt: skip

    def unpin(self, lease_id: str) -> bool:
        return self.client.unpin(lease_id)

    def stats(self):
        return self.client.server_stats(timeout=60)

    def close(self) -> None:
        self.client.close()


_DEFAULTS = SamplingParams()


def _load_tokenizer(model: str):
    from jaxserve.models.checkpoint import open_checkpoint
    from jaxserve.models.fetch import default_cache_dir, resolve_model

    return open_checkpoint(resolve_model(model, None), default_cache_dir()).tokenizer()
