"""`LLM`: the offline Python API. Loads a checkpoint in-process and generates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from preload.worker.checkpoint import load_checkpoint
from preload.worker.config import ModelConfig
from preload.worker.kv_cache import AttentionMeta, LatentCache
from preload.worker.model import Transformer
from preload.worker.sampler import SamplingParams, sample
from preload.worker.tokenizer import Tokenizer

QUANT_MODES = ("none",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Completion:
    """One prompt's result. `prompt_logprobs[i]` is log p(prompt[i] | prompt[:i]),
    None for the first token; `logprobs[i]` that of the i-th generated token."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    prompt_logprobs: list[float | None] | None = None
    finish_reason: str | None = None  # "stop" (end of sequence) or "length"


def resolve_dtype(dtype: str | None, device: torch.device, cfg: ModelConfig) -> torch.dtype:
    """Explicit dtype wins; otherwise bf16 on GPUs and the checkpoint's own dtype on CPU."""
    name = dtype or ("bfloat16" if device.type == "cuda" else cfg.torch_dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLM:
    def __init__(self, model: str | Path, quant: str = "none", device: str = "cpu", dtype: str | None = None):
        if quant not in QUANT_MODES:
            raise ValueError(f"quant {quant!r} not supported; choose one of {', '.join(QUANT_MODES)}")
        self.model_dir = Path(model)
        self.config = ModelConfig.from_dir(self.model_dir)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device, self.config)
        self.tokenizer = Tokenizer(self.model_dir)
        weights = load_checkpoint(self.model_dir, self.config, self.dtype, self.device)
        self.model = Transformer(self.config, weights)
        self.stop_ids = set(self.config.eos_token_ids) | {self.tokenizer.eos_id} - {None}

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}")
        return ids

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        logprobs: bool = False,
        prompt_logprobs: bool = False,
    ) -> list[Completion]:
        params = SamplingParams(max_tokens, temperature, top_p, seed, bool(logprobs), bool(prompt_logprobs))
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        results = [Completion(self._prompt_ids(p)) for p in prompts]
        limit = self.config.max_position_embeddings
        for r in results:
            if len(r.prompt_token_ids) + max_tokens > limit:
                raise ValueError(f"prompt ({len(r.prompt_token_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context length {limit}")
        self._run(results, params)
        for r in results:
            r.text = self.tokenizer.decode(r.token_ids)
        return results

    def _run(self, results: list[Completion], params: SamplingParams) -> None:
        """Prefill every prompt in one step, then decode all unfinished sequences together."""
        dev = self.device
        lengths = [len(r.prompt_token_ids) + params.max_tokens for r in results]
        offsets = [sum(lengths[:i]) for i in range(len(results))]
        slots = [torch.arange(o, o + n, device=dev) for o, n in zip(offsets, lengths)]
        cache = LatentCache(self.model.num_cache_layers, sum(lengths), self.config, self.dtype, dev)
        gens = [self._generator(params.seed) for _ in results]

        prompts = [r.prompt_token_ids for r in results]
        meta = AttentionMeta.build([(0, len(p), s[: len(p)]) for p, s in zip(prompts, slots)], dev)
        hidden = self.model.forward(torch.tensor(sum(prompts, []), device=dev), meta, cache)
        ends = torch.tensor([len(p) for p in prompts], device=dev).cumsum(0) - 1
        if params.prompt_logprobs:
            logp = self.model.logits(hidden).log_softmax(-1)
            start = 0
            for r, p in zip(results, prompts):
                rows = logp[start : start + len(p) - 1]
                picked = rows.gather(1, torch.tensor(p[1:], device=dev)[:, None])[:, 0]
                r.prompt_logprobs = [None, *picked.tolist()]
                start += len(p)
            last = logp[ends]
        else:
            last = self.model.logits(hidden[ends]).log_softmax(-1)

        if params.logprobs:
            for r in results:
                r.logprobs = []
        active = list(range(len(results)))
        while active:
            still = []
            for row, i in enumerate(active):
                r = results[i]
                token = sample(last[row], params, gens[i])
                r.token_ids.append(token)
                if params.logprobs:
                    r.logprobs.append(float(last[row, token]))
                if token in self.stop_ids:
                    r.finish_reason = "stop"
                elif len(r.token_ids) >= params.max_tokens:
                    r.finish_reason = "length"
                else:
                    still.append(i)
            active = still
            if not active:
                break
            ctx = [len(results[i].prompt_token_ids) + len(results[i].token_ids) for i in active]
            meta = AttentionMeta.build([(n - 1, 1, slots[i][:n]) for i, n in zip(active, ctx)], dev)
            tokens = torch.tensor([results[i].token_ids[-1] for i in active], device=dev)
            last = self.model.logits(self.model.forward(tokens, meta, cache)).log_softmax(-1)

    def _generator(self, seed: int | None) -> torch.Generator:
        gen = torch.Generator()
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        return gen
