"""Wires one engine from a config; the offline ``LLM`` and the server both start here::

    EngineConfig ──resolve_plan──▶ EnginePlan ──assemble──▶ EngineHandle
                                                  checkpoint + weights -> ModelRunner
                                                  KVManager -> Scheduler
                                                  Engine(runner, scheduler, tokenizer)

The handle is what a front end needs and nothing more: the engine (to step or to hand to
an ``EngineThread``), the plan and model config (limits, model info), and ``encode``
(prompt text, token ids or chat messages to token ids).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxserve import compile_cache
from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.kv_manager import KVManager
from jaxserve.engine.scheduler import Scheduler
from jaxserve.errors import RequestError, check_prompt_ids, check_text, prompt_too_long
from jaxserve.models.checkpoint import open_checkpoint
from jaxserve.models.config import ModelConfig
from jaxserve.models.fetch import default_cache_dir, resolve_model
from jaxserve.models.loading import int8_weights, load_model, weight_bytes
from jaxserve.models.quant import Int8Weights
from jaxserve.parallel.multihost import DistributedConfig, initialize
from jaxserve.plan import EnginePlan, check_memory, device_free_bytes, resolve_plan
from jaxserve.runner.model_runner import ModelRunner

ChatMessages = list[dict[str, str]]
Prompt = str | list[int] | ChatMessages
NOT_A_PROMPT = "a prompt must be a string, a list of token ids, or a list of chat messages"
# apply_chat_template's own parameters, and the variables it sets from them: a
# chat_template_kwargs entry by one of these names would not reach the template as a variable
# (or would fight the request's own field for it).
RESERVED_TEMPLATE_NAMES = (
    "add_generation_prompt",
    "chat_template",
    "continue_final_message",
    "conversation",
    "documents",
    "max_length",
    "messages",
    "padding",
    "return_assistant_tokens_mask",
    "return_dict",
    "return_tensors",
    "tokenize",
    "tokenizer_kwargs",
    "tools",
    "truncation",
)


def template_variables(chat_template_kwargs: Any, field: str = "chat_template_kwargs") -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``, checked: a mapping of variable names to values for the
    chat template ({} for None); errors name ``field``.

    Raises:
        RequestError: not a mapping of names, or a reserved name.
    """
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
        raise RequestError(f"{field}: a mapping of the chat template's variable names to their values")
    for name in chat_template_kwargs:
        if name in RESERVED_TEMPLATE_NAMES:
            raise RequestError(
                f"{field}.{name}: not a variable this server passes to the template (a request "
                f"field or apply_chat_template's own); reserved: {', '.join(RESERVED_TEMPLATE_NAMES)}"
            )
    return dict(chat_template_kwargs)


@dataclasses.dataclass(frozen=True)
class EngineHandle:
    config: EngineConfig
    plan: EnginePlan
    model_config: ModelConfig
    tokenizer: Any
    engine: Engine
    quant: Int8Weights | None = None  # the int8 layouts (quantization: int8)

    @property
    def numerics(self) -> str:
        """What start-up reports: the plan's dtypes and where int8 weights came from."""
        return self.plan.numerics + (f"; {self.quant.report()}" if self.quant else "")

    @property
    def max_model_len(self) -> int:
        return self.plan.max_model_len

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token of the vocabulary (a piece of a character included)."""
        return self.engine.grammars.token_bytes(token_id)

    def _keep_last(self, k: int | None) -> int | None:
        """vLLM's truncate_prompt_tokens as the number of the prompt's last tokens to keep."""
        room = self.max_model_len - 1
        if k is None:
            return None
        if k == -1:
            return room
        if not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= room):
            raise RequestError(
                f"truncate_prompt_tokens = {k!r}: must be -1 (as many as the context holds) or from 1 to {room} "
                "(max_model_len - 1: room for a token)"
            )
        return k

    def encode(self, prompt: Prompt, field: str = "prompt", **options: Any) -> list[int]:
        """``encode_with_text``'s token ids alone."""
        return self.encode_with_text(prompt, field, **options)[0]

    def encode_with_text(
        self,
        prompt: Prompt,
        field: str = "prompt",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        truncate_prompt_tokens: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], str | None]:
        """Token ids of a text, token-id list or chat message list (template applied),
        shorter than max_model_len; errors name ``field`` (the wire calls it token_ids.ids).
        A chat ends with the assistant's header (``add_generation_prompt``), or with its
        last message left open for the model to go on with (``continue_final_message``), or
        neither: the turn closed; ``chat_template_kwargs`` (vLLM's): more variables for the
        template, such as Qwen3's ``enable_thinking``. ``truncate_prompt_tokens`` (vLLM's):
        only the prompt's last k tokens are kept, before the length is checked; -1: as many
        as the context holds.
        With them, the text they came from: the prompt itself, a chat's rendering by the
        template, or None for token ids (vLLM's ``RequestOutput.prompt``)."""
        keep_last = self._keep_last(truncate_prompt_tokens)
        text = None
        if isinstance(prompt, str):
            check_text(prompt, field)
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            for i, m in enumerate(prompt):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise RequestError(f"messages[{i}] must have string 'role' and 'content'")
                check_text(m["role"], f"{field}[{i}].role")
                check_text(m["content"], f"{field}[{i}].content")
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError(
                    f"{field}: this model's tokenizer has no chat template; send the prompt as text or token ids"
                )
            # The chat's options are named beside the messages' field: chat.messages' kwargs are
            # chat.chat_template_kwargs (gRPC), messages' are chat_template_kwargs (HTTP, LLM.chat).
            beside = field[: field.rfind(".") + 1]
            if continue_final_message and add_generation_prompt:
                raise RequestError(
                    f"{beside}continue_final_message = true: only with {beside}add_generation_prompt = false "
                    "(the last message is continued, not answered)"
                )
            variables = template_variables(chat_template_kwargs, f"{beside}chat_template_kwargs")
            try:
                text = self.tokenizer.apply_chat_template(
                    prompt,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    tokenize=False,
                    **variables,
                )
            except ValueError as e:  # continue_final_message: the last message's text is not in what it gives
                raise RequestError(f"{field}: {str(e)[:300]}") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(prompt, list):
            prompt = prompt[-keep_last:] if keep_last else prompt
            if len(prompt) >= self.max_model_len:  # before a walk of every id: 5M of them took ~1 s
                raise RequestError(prompt_too_long(field, len(prompt), self.max_model_len))
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise RequestError(NOT_A_PROMPT)
            ids = list(prompt)
        else:
            raise RequestError(NOT_A_PROMPT)
        if keep_last:
            ids = ids[-keep_last:]
        check_prompt_ids(ids, self.max_model_len, self.model_config.vocab_size, field)
        return ids, text


def assemble(cfg: EngineConfig, progress: bool = True, warmup: bool = False) -> EngineHandle:
    """Joins the cluster (if any), loads the model and builds the engine. ``warmup``: the
    runner's warm-up starts as soon as the runner exists (``ModelRunner.start_warmup``;
    ``warmup()`` then waits for it), beside the tokenizer's load."""
    distributed = DistributedConfig.from_option(cfg.distributed)
    if distributed is not None:  # before anything else touches JAX
        initialize(distributed)
    program_dir = weight_dir = None
    if cfg.compile_cache:  # before the first compile
        program_dir = compile_cache.use(cfg.cache_dir)
        weight_dir = compile_cache.folder(cfg.cache_dir) / "weights"
    else:
        compile_cache.disable()
    ckpt = open_checkpoint(resolve_model(cfg.model, cfg.cache_dir), cfg.cache_dir or default_cache_dir())
    mcfg = ckpt.config
    plan = resolve_plan(cfg, mcfg)
    packed = plan.matmul in ("onednn", "amx")
    quant = int8_weights(mcfg, plan.weight_dtype, ckpt, fused=packed) if plan.quantization == "int8" else None
    weights = weight_bytes(mcfg, plan.dtype, plan.weight_dtype, packed=packed, quant=quant)
    check_memory(plan, weights, device_free_bytes(jax.local_devices()[0]))
    kv = KVManager(plan.num_pages, cfg.page_size, cfg.enable_prefix_caching, cfg.prefix_match)
    model = load_model(
        ckpt,
        plan.dtype,
        progress=progress,
        mesh=plan.mesh,
        weight_dtype=plan.weight_dtype,
        packed=packed,
        quant=quant,
        cache=weight_dir,
    )
    # The runner first: it starts zeroing the KV cache (and warming up) on threads of its
    # own, which the tokenizer's load (mostly importing transformers) then overlaps.
    runner = ModelRunner(model, plan.runner, program_dir)
    if warmup:
        runner.start_warmup(progress)
    try:
        tokenizer = ckpt.tokenizer()
        eos = set(mcfg.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        engine = Engine(runner, make_scheduler(cfg, plan, kv), tokenizer, eos, overlap=cfg.overlap_scheduling)
    except BaseException:  # a bad tokenizer, Ctrl-C: no warm-up is left running
        runner.cancel_warmup()
        raise
    return EngineHandle(cfg, plan, mcfg, tokenizer, engine, quant)


def make_scheduler(cfg: EngineConfig, plan: EnginePlan, kv: KVManager) -> Scheduler:
    """The scheduler of the plan's budgets (max_mixed_batched_tokens and
    max_long_mixed_batched_tokens as resolved: auto's values, the buckets the runner
    compiled for them)."""
    return Scheduler(
        kv,
        cfg.max_num_batched_tokens,
        cfg.max_num_seqs,
        plan.max_model_len,
        schedule_policy=cfg.schedule_policy,
        lpm_aging_steps=cfg.lpm_aging_steps,
        min_token_bucket=plan.runner.min_token_bucket,
        max_mixed_batched_tokens=plan.runner.max_mixed_batched_tokens,
        max_long_mixed_batched_tokens=plan.runner.max_long_mixed_batched_tokens,
    )
