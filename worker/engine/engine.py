"""The engine: one step = schedule, run the model over a flat batch, sample, update."""

from __future__ import annotations

import torch

from preload.worker.engine.block_manager import BlockManager
from preload.worker.model.kv_cache import AttentionMeta, LatentCache, bytes_per_token
from preload.worker.model.deepseek import Transformer
from preload.worker.engine.scheduler import Scheduler
from preload.worker.engine.sampler import sample
from preload.worker.engine.sequence import Sequence
from preload.checkpoint.tokenizer import Tokenizer
from preload.options import EngineOptions


class RequestError(ValueError):
    """A request the engine cannot serve as asked (too long, ids outside the vocabulary)."""


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineOptions, device: torch.device):
        """config.kv_cache_memory must be a number of bytes here: `auto` (None) is for
        the caller to resolve (worker.serve.kv_cache_bytes, or LLM's default)."""
        self.model, self.tokenizer, self.config, self.device = model, tokenizer, config, device
        cfg = model.cfg
        dtype = model.embed.dtype
        if config.kv_cache_memory is None:
            raise ValueError("kv_cache_memory is None (auto): resolve it to a number of bytes first")
        per_block = config.block_size * bytes_per_token(cfg, cfg.num_layers, dtype, config.kv_cache_dtype)
        num_blocks = config.kv_cache_memory // per_block
        if num_blocks < 1:
            raise ValueError(f"kv cache budget of {config.kv_cache_memory} bytes holds no block of {per_block} bytes")
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.cache = LatentCache(cfg.num_layers, num_blocks * config.block_size, cfg, dtype, device, config.kv_cache_dtype)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.stop_ids = frozenset(cfg.eos_token_ids) | ({tokenizer.eos_id} - {None})

    @property
    def max_model_len(self) -> int:
        return min(self.model.cfg.max_position_embeddings, self.blocks.num_blocks * self.blocks.block_size)

    def check(self, prompt: list[int], max_tokens: int) -> None:
        """Raise RequestError if this request can never be served."""
        if not prompt:
            raise RequestError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(prompt) + max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context length {self.max_model_len}"
            )

    def add(self, seq: Sequence) -> None:
        self.check(seq.prompt, seq.params.max_tokens)
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        if not seq.finished:
            self.scheduler.finish(seq, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one batch; return the sequences that produced a token or finished."""
        batch = self.scheduler.schedule()
        if not batch:
            return []
        dev = self.device
        spans = [(seq, seq.computed, n) for seq, n in batch]
        tokens = [t for seq, start, n in spans for t in seq.tokens[start : start + n]]
        meta = AttentionMeta.build([(start, n, self.blocks.slots(seq, start + n)) for seq, start, n in spans], dev)
        hidden = self.model.forward(torch.tensor(tokens, device=dev), meta, self.cache)

        # Logits only where needed: each sequence's last row when its pending tokens are
        # all in, and every row of a prompt that is being scored.
        row, rows, wanted = 0, [], []
        for seq, start, n in spans:
            first = len(rows)
            scoring = seq.wants_prompt_logprobs
            span_rows = range(row, row + n) if scoring else range(row + n - 1, row + n)
            rows.extend(span_rows)
            wanted.append((first, scoring))
            row += n
        logprobs = self.model.logits(hidden[torch.tensor(rows, device=dev)]).log_softmax(-1).cpu()

        updated = []
        for (seq, start, n), (first, scoring) in zip(spans, wanted):
            seq.computed += n
            if scoring:
                # Row i predicts prompt[start + i + 1]; a preempted sequence recomputes rows
                # whose log-probs it already has, so start after those.
                lo, hi = len(seq.prompt_logprobs) - 1 - start, min(n, len(seq.prompt) - 1 - start)
                targets = torch.tensor(seq.prompt[start + 1 + lo : start + 1 + hi], dtype=torch.long)
                picked = logprobs[first + lo : first + hi].gather(1, targets[:, None])[:, 0]
                seq.prompt_logprobs.extend(picked.tolist())
            if seq.pending == 0:
                last = logprobs[first + (n - 1 if scoring else 0)]
                self._append(seq, last)
                updated.append(seq)
        return updated

    def _append(self, seq: Sequence, logprobs: torch.Tensor) -> None:
        p = seq.params
        token = sample(logprobs, p, seq.generator, seq.output)
        seq.output.append(token)
        if p.logprobs is not None:
            seq.logprobs.append(float(logprobs[token]))
            if p.logprobs > 0:
                top = logprobs.topk(p.logprobs)
                seq.top_logprobs.append(dict(zip(top.indices.tolist(), top.values.tolist())))
        if (token in self.stop_ids and not p.ignore_eos) or token in p.stop_token_ids:
            self.scheduler.finish(seq, "stop")
        elif p.stop and self._hit_stop_string(seq):
            self.scheduler.finish(seq, "stop")
        elif len(seq.output) >= p.max_tokens:
            self.scheduler.finish(seq, "length")

    def _hit_stop_string(self, seq: Sequence) -> bool:
        # Only the tail can contain a new match: decode enough tokens to cover the longest stop string.
        tail = self.tokenizer.decode(seq.output[-(max(map(len, seq.params.stop)) + 8) :])
        return any(s in tail for s in seq.params.stop)

    def text(self, seq: Sequence) -> str:
        """The generated text, cut before a stop string if one ended the sequence."""
        text = self.tokenizer.decode(seq.output)
        cuts = [i for i in (text.find(s) for s in seq.params.stop) if i >= 0]
        return text[: min(cuts)] if cuts else text

    def run_to_completion(self) -> None:
        while self.has_work():
            self.step()
