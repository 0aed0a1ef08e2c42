"""Offline API: ``LLM(model).generate(prompts, SamplingParams(...))``.

Every token goes through the KV pages and the jitted step the server will use. In this
version requests run one after another; each prompt is prefilled in chunks of up to
``max_num_batched_tokens`` tokens, then decoded one token per step.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from jaxserve.config import EngineConfig
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.page_pool import PagePool
from jaxserve.errors import ConfigError, RequestError
from jaxserve.models.checkpoint import open_checkpoint
from jaxserve.models.fetch import resolve_model
from jaxserve.models.loading import default_dtype, load_model
from jaxserve.runner.batch import ScheduledSeq
from jaxserve.runner.model_runner import ModelRunner, RunnerConfig
from jaxserve.sampling_params import SamplingParams

ChatMessages = list[dict[str, str]]
Prompt = str | list[int] | ChatMessages


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    cumulative_logprob: float = 0.0


class LLM:
    """Loads a model (alias, Hugging Face directory or .gguf) and generates from it."""

    def __init__(
        self,
        model: str = EngineConfig.model,
        *,
        config: EngineConfig | None = None,
        progress: bool = True,
        **engine_options: Any,
    ):
        if config is not None and engine_options:
            raise ConfigError("give either config= or engine options, not both")
        self.config = config or EngineConfig.from_options(model=model, **engine_options)
        cfg = self.config
        ckpt = open_checkpoint(resolve_model(cfg.model, cfg.cache_dir))
        self.model_config = mcfg = ckpt.config
        self.tokenizer = ckpt.tokenizer()
        dtype = cfg.dtype or default_dtype()
        self.max_model_len = cfg.max_model_len or min(mcfg.max_position_embeddings, 8192)
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ConfigError(
                f"max_model_len = {self.max_model_len}: must be <= the model's "
                f"max_position_embeddings ({mcfg.max_position_embeddings})"
            )
        num_pages = cfg.num_pages
        if num_pages is None:
            itemsize = 4 if dtype == "float32" else 2
            per_page = mcfg.kv_bytes_per_token * itemsize * cfg.page_size
            num_pages = max(int(cfg.kv_cache_memory_gb * 2**30 // per_page), 2)
        self.pool = PagePool(num_pages, cfg.page_size)
        if self.pool.num_usable < self.pool.pages_needed(self.max_model_len):
            self.max_model_len = self.pool.num_usable * cfg.page_size
        model = load_model(ckpt, dtype, progress=progress)
        self.runner = ModelRunner(
            model,
            RunnerConfig(
                page_size=cfg.page_size,
                num_pages=num_pages,
                max_model_len=self.max_model_len,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs,
                attention_backend=cfg.attention_backend,
            ),
        )
        self.eos_token_ids = set(mcfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

    # -- prompts -------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text, token-id list or chat message list (template applied)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            for i, m in enumerate(prompt):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise RequestError(f"messages[{i}] must have string 'role' and 'content'")
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt token id {bad[0]} is out of range; allowed: 0..{self.model_config.vocab_size - 1}"
                )
        else:
            raise RequestError("a prompt must be a string, a list of token ids, or a list of chat messages")
        if not ids:
            raise RequestError("the prompt is empty")
        return ids

    @staticmethod
    def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, list) and prompts and all(isinstance(p, (int, dict)) for p in prompts):
            return [prompts]
        return list(prompts)

    # -- generation ----------------------------------------------------------------
    def _run(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[tuple[int, float, str | None]]:
        """Yields (token, logprob, finish_reason or None) for each generated token."""
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        tokens = list(prompt_ids)
        pages: list[int] = []
        computed = 0
        budget = self.config.max_num_batched_tokens
        try:
            while True:
                chunk = tokens[computed : computed + budget]
                need = self.pool.pages_needed(computed + len(chunk)) - len(pages)
                if need > 0:
                    pages += self.pool.allocate(need)
                token, logprob = self.runner.execute([ScheduledSeq(chunk, computed, pages)], [params], [seed])
                computed += len(chunk)
                if computed < len(tokens):
                    continue  # a prefill chunk: its sample is not a new token
                token, logprob = int(token[0]), float(logprob[0])
                tokens.append(token)
                generated = len(tokens) - len(prompt_ids)
                finish = None
                if token in stop_ids and generated > params.min_tokens:
                    finish = "stop"
                elif generated >= params.max_tokens or len(tokens) >= self.max_model_len:
                    finish = "length"
                yield token, logprob, finish
                if finish:
                    return
        finally:
            self.pool.release(pages)

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generates a completion for each prompt; outputs are in prompt order."""
        params = sampling_params or SamplingParams()
        encoded = [self.encode(p) for p in self._as_list(prompts)]
        outputs = []
        for ids in encoded:
            out = RequestOutput(ids, [], "", "length")
            detok = IncrementalDetokenizer(self.tokenizer, ids)
            for token, logprob, finish in self._run(ids, params):
                if not (finish == "stop" and token in self.eos_token_ids | set(params.stop_token_ids)):
                    out.text += detok.add(token)
                out.token_ids.append(token)
                out.cumulative_logprob += logprob
                out.finish_reason = finish or out.finish_reason
            outputs.append(out)
        return outputs

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas of one completion as tokens are generated."""
        ids = self.encode(prompt)
        detok = IncrementalDetokenizer(self.tokenizer, ids)
        params = sampling_params or SamplingParams()
        for token, _, finish in self._run(ids, params):
            if finish == "stop":
                return
            delta = detok.add(token)
            if delta:
                yield delta

    @property
    def platform(self) -> str:
        return jax.default_backend()
