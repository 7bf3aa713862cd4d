"""The engine: one step = schedule, run the model over a flat batch, then each sequence's
own work (sampling, logprobs, structured output) and an Output of tokens for each (their
text is the reader's work: output_text.py).

The forward is the whole batch's: if it fails, the engine is broken and the exception
goes up to whoever drives it (the worker exits and is replaced). A sequence's own work
runs in stages (faults.py): its failure ends that sequence alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from preload.checkpoint.tokenizer import Tokenizer
from preload.ipc.kv_memory import KvMemory
from preload.options import EngineOptions
from preload.worker.engine.block_ledger import KEY_BYTES, BlockLedger, layout_key, ledger_bytes
from preload.worker.engine.block_manager import BlockManager
from preload.worker.engine.cuda_graphs import DecodeGraphs, fed_rows
from preload.worker.engine.attention_warmup import AttentionWarmup
from preload.worker.engine.prompt_graphs import PromptGraphs
from preload.worker.engine.faults import GrammarRefused, SequenceFault, stage
from preload.worker.engine.grammar import Grammars
from preload.worker.engine.host_logprobs import drawn_on_host, score_prompt
from preload.worker.model.host_values import on_device
from preload.worker.engine.logits_processors import Batch, ProcessorContext, apply_processors, load_processors
from preload.worker.engine.output import Output
from preload.worker.engine.flight import decoding, spans_of
from preload.worker.engine.pipeline import StepPipeline
from preload.worker.engine.sampler import sample, sample_batch, steer
from preload.worker.engine.sampling_params import RequestError
from preload.worker.engine.scheduler import Scheduler
from preload.worker.engine.sequence import CacheSource, Sequence
from preload.worker.engine.speculative import Drafter, SpecConfig, accept, check_drafter, fed_tokens, judged_together
from preload.worker.engine.step_clock import StepClock
from preload.worker.model.deepseek import Transformer
from preload.worker.model.kv_cache import AttentionMeta, CacheMemory, LatentCache, bytes_per_token

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    waiting: int  # sequences queued for their first (or, preempted, next) step
    running: int  # sequences in the running batch
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int  # so far
    prefix_queried_tokens: int  # so far: tokens looked up in the prefix cache, and found there
    prefix_hit_tokens: int
    spec_draft_tokens: int  # so far: tokens the drafter proposed, and those the target accepted
    spec_accepted_tokens: int
    max_model_len: int  # prompt + max_tokens of one sequence at most
    # so far (step_clock.py): steps of each kind, their seconds, and the host's wait on the GPU
    prompt_steps: int = 0
    decode_steps: int = 0
    decode_ahead_steps: int = 0
    prompt_step_seconds: float = 0.0
    decode_step_seconds: float = 0.0
    decode_ahead_step_seconds: float = 0.0
    gpu_wait_seconds: float = 0.0
    graphs_pending: int = 0  # CUDA graph buckets (decode and prompt steps) still to capture, eager attention shapes to launch


def check_sequence(seq: Sequence, vocab: int, max_model_len: int) -> None:
    """Raise RequestError if an engine of this vocabulary and context length can never
    serve `seq`. With SamplingParams' own ranges this is all the checking a request gets:
    callers run it once per sequence before `add`, and the engine trusts what it is given.
    (A worker's front runs it against its core's limits: front.py.)"""
    prompt, p = seq.prompt, seq.params
    if not prompt:
        raise RequestError("the prompt is empty", "prompt")
    for param, ids in (("prompt", prompt), ("output", seq.output), ("logit_bias", [t for t, _ in p.logit_bias]),
                       ("stop_token_ids", p.stop_token_ids)):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            prefix = "" if param == "prompt" else f"{param}: "
            raise RequestError(f"{prefix}token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param)
    if p.logprobs is not None and p.logprobs > vocab:
        raise RequestError(f"logprobs must be at most the vocabulary size {vocab}, got {p.logprobs}", "logprobs")
    if len(prompt) + p.max_tokens > max_model_len:
        raise RequestError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) exceeds the context length {max_model_len}",
            "prompt",
        )


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineOptions, device: torch.device,
                 graphs: DecodeGraphs | None = None, fingerprint: str = "", draft: Transformer | None = None,
                 kv_memory: Callable[[int], KvMemory] | None = None, prompt_graphs: PromptGraphs | None = None,
                 draft_graphs: DecodeGraphs | None = None):
        """config.kv_cache_memory must be a number of bytes here: `auto` (None) is for
        the caller to resolve (worker.serve.kv_cache_bytes, or LLM's default). With
        `graphs` (captured or to be captured against this engine's cache), decode steps
        that fit them are replayed; with `prompt_graphs` (prompt_graphs.py), the other steps
        are replayed piecewise. `fingerprint`: the weights', part of every prefix-cache key.
        `draft`: the draft model of --speculative-config's method draft_model.
        `draft_graphs`: the drafter's steps captured (the MTP layer's, over `graphs`'
        address table; or the draft model's, over its own cache).
        `kv_memory`: gives the memory the caches are cut from, for the bytes they need
        (a supervised worker's, which outlives it: ipc/kv_memory.py); else the caches
        are allocated as tensors."""
        self.model, self.tokenizer, self.config, self.device = model, tokenizer, config, device
        cfg = model.cfg
        dtype = model.embed.dtype
        if config.kv_cache_memory is None:
            raise ValueError("kv_cache_memory is None (auto): resolve it to a number of bytes first")
        spec = SpecConfig.parse(config.speculative_config)
        check_drafter(spec, model, draft)
        mtp = spec is not None and spec.method == "mtp"
        layers = model.num_cache_layers if mtp else cfg.num_layers  # the MTP layer's latents: one layer more
        per_block = config.block_size * bytes_per_token(cfg, layers, dtype, config.kv_cache_dtype)
        if draft is not None:  # and the draft model's own, in blocks of the same tables
            per_block += config.block_size * bytes_per_token(draft.cfg, draft.cfg.num_layers, draft.embed.dtype,
                                                             config.kv_cache_dtype)
        num_blocks = config.kv_cache_memory // per_block
        if num_blocks < 1:
            raise ValueError(f"kv cache budget of {config.kv_cache_memory} bytes holds no block of {per_block} bytes")
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.fingerprint = fingerprint
        # One block more than the manager hands out: the scratch block that a graph's padding rows use.
        self.scratch_block = num_blocks
        self.graphs, self.prompt_graphs = graphs, prompt_graphs
        slots = (num_blocks + 1) * config.block_size
        memory, self.kv_memory = None, None
        if kv_memory is not None:
            need = LatentCache.nbytes(layers, slots, cfg, dtype, config.kv_cache_dtype)
            if draft is not None:
                need += LatentCache.nbytes(draft.cfg.num_layers, slots, draft.cfg, draft.embed.dtype, config.kv_cache_dtype)
            pools = need
            need += CacheMemory.aligned(ledger_bytes(num_blocks))
            self.kv_memory = kv_memory(need)
            memory = CacheMemory(self.kv_memory)
        self.cache = LatentCache(layers, slots, cfg, dtype, device, config.kv_cache_dtype,
                                 ptrs=graphs.cache_ptrs if graphs else None, memory=memory)
        if memory is not None:  # the blocks the slot's last core keyed, taken up (block_ledger.py)
            ledger = BlockLedger(memory.take((num_blocks + 1, KEY_BYTES), torch.uint8),
                                 layout_key(num_blocks, config.block_size, pools, str(dtype), config.kv_cache_dtype))
            if config.enable_prefix_caching and spec is None:
                log.info("%d cached blocks taken up from the slot's last core", self.blocks.keep_ledger(ledger))
            else:
                ledger.reset()
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_num_active_seqs, config.long_prefill_token_threshold)
        self.stop_ids = frozenset(cfg.eos_token_ids) | ({tokenizer.eos_id} - {None})
        self.processors = load_processors(config.logits_processors, ProcessorContext(cfg.vocab_size, device, self.stop_ids))
        self.drafter = None
        shape = self._drafter_rows if self.processors else None
        if mtp:
            self.drafter = Drafter(spec, self.blocks, device, model, self.cache, shape, draft_graphs, self.scratch_block)
        elif spec is not None:
            draft_cache = LatentCache(draft.cfg.num_layers, slots, draft.cfg, draft.embed.dtype, device,
                                      config.kv_cache_dtype, ptrs=draft_graphs.cache_ptrs if draft_graphs else None,
                                      memory=memory)
            self.drafter = Drafter(spec, self.blocks, device, draft, draft_cache, shape, draft_graphs,
                                   self.scratch_block)
        self.grammars = Grammars(tokenizer, cfg.vocab_size, self.stop_ids)
        # The eager attention's kernels, compiled while idle (attention_warmup.py); a CPU compiles none.
        self.warmup = None
        if device.type == "cuda" and self.cache.ptrs is not None:
            self.warmup = AttentionWarmup(model, self.cache, config.block_size, self.scratch_block,
                                          config.max_num_seqs, device)
        # Steps launched ahead of the last one's tokens (pipeline.py); on a CPU nothing would overlap.
        self.pipeline = StepPipeline(self) if config.async_scheduling and device.type == "cuda" else None
        self.clock = StepClock()

    @property
    def max_model_len(self) -> int:
        """The model's context, or what the KV cache holds, or the operator's --max-model-len: the least."""
        longest = min(self.model.cfg.max_position_embeddings, self.blocks.num_blocks * self.blocks.block_size)
        return min(longest, self.config.max_model_len or longest)

    def check(self, seq: Sequence) -> None:
        """Raise RequestError if this engine can never serve `seq` (check_sequence)."""
        check_sequence(seq, self.model.cfg.vocab_size, self.max_model_len)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence that passed `check`. One with output already (a request
        resumed after the engine it ran on died) goes on from there: its prompt and output
        are computed again as one prefill, its grammar has read the output, its seeded
        draws are keyed by position (Sequence.generator_at), its penalties count the output:
        it draws what it would have drawn. (Its grammar refusing that output raises
        RequestError: the output did not come from this request.)"""
        seq.cache_source = CacheSource(self.fingerprint, seq.params.cache_salt)
        if seq.params.seed is not None and not seq.params.greedy:
            seq.generator = torch.Generator(self.device)  # (seeded at each draw: Sequence.generator_at)
        if seq.params.grammar is not None:
            seq.matcher = self.grammars.matcher(seq.params.grammar)
            for token in seq.output:
                if not seq.matcher.consume_token(token):
                    raise RequestError(f"the grammar refuses the output's token {token}", "output")
        self.scheduler.add(seq)

    def abort(self, seq: Sequence) -> None:
        if not seq.finished:
            self.scheduler.finish(seq, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work() or (self.pipeline is not None and self.pipeline.busy())

    def capture_idle(self) -> bool:
        """Capture the smallest decode graph a lazy start left (cuda_graphs.py), then a few
        pieces of the largest bucket of prompt steps not captured yet (prompt_graphs.py: the
        token budget is the size a busy engine's steps take most), then launch one shape of
        eager attention not launched yet (attention_warmup.py), between steps, while nothing
        waits; False if none is left."""
        if self.has_work() or not self.graphs_pending():
            return False
        if self.graphs is not None and self.graphs.pending:
            return self._capture(self.graphs.pending[:1])
        prompts = self.prompt_graphs
        if prompts is not None and prompts.pending:
            prompts.capture(prompts.pending[-1], self.cache, self.scratch_block * self.blocks.block_size, most=4)
        else:
            self.warmup.run_one()  # (what graphs_pending counted last: a shape of it)
        return True

    def _capture(self, sizes: list[int]) -> bool:
        return self.graphs.ensure(self.cache, self.scratch_block, sizes)

    def stats(self) -> EngineStats:
        """Safe to call from another thread: each number is read once, none is changed."""
        s, b = self.scheduler, self.blocks
        d = self.drafter
        return EngineStats(len(s.waiting), len(s.running), b.used, b.num_blocks, s.preemptions, b.queried_tokens,
                           b.hit_tokens, d.drafted if d else 0, d.accepted if d else 0, self.max_model_len,
                           *self.clock.totals(), self.graphs_pending())

    def graphs_pending(self) -> int:
        """The graph buckets a step of their size would capture first (0.1-0.6 s on the
        H200) and an idle engine captures one at a time (capture_idle): the target's decode
        (and verify) steps' and, without a drafter, the prompt steps'; and the shapes of
        eager attention whose kernels a step would compile first (attention_warmup.py)."""
        return sum(len(g.pending) for g in (self.graphs, self.prompt_graphs, self.warmup) if g is not None)

    @torch.inference_mode()
    def step(self) -> list[Output]:
        """Run one batch; return an Output for each sequence that produced a token or failed
        (with --async-scheduling, the batch launched by the call before, if it was: pipeline.py)."""
        self.clock.start()
        try:
            if self.pipeline is not None:
                return self.pipeline.step()
            return self.run(self.scheduler.schedule())
        finally:
            self.clock.stop()

    def run(self, batch: list[tuple[Sequence, int]]) -> list[Output]:
        """One scheduled batch of (sequence, tokens to compute), start to finish."""
        if not batch:
            return []
        self.clock.kind = "decode" if decoding(batch) else "prompt"
        spans = spans_of(batch)
        # Logits only where needed: each sequence's last row when its pending tokens are
        # all in, and every row of a prompt that is being scored.
        row, rows, wanted = 0, [], []
        for seq, start, n in spans:
            first = len(rows)
            every = seq.wants_prompt_logprobs or bool(seq.drafts)  # scoring a prompt, or verifying drafts
            span_rows = range(row, row + n) if every else range(row + n - 1, row + n)
            rows.extend(span_rows)
            wanted.append((first, every))
            row += n
        # Log-probs stay on the device: only sampled ids, and the log-probs a request asked
        # for, come to the host.
        logprobs, hidden = self.forward(spans, rows)

        outputs, advancing, verifying = [], [], []  # advancing: (sequence, its row) of those that sample a token
        for (seq, start, n), (first, scoring) in zip(spans, wanted):  # (every row, past drafts: a prompt scored)
            if seq.drafts:  # how much of it counts is known once the drafts are judged
                verifying.append((seq, start, first, n))
                continue
            seq.computed += n
            self.blocks.cache_full_blocks(seq)
            try:
                if scoring:
                    with stage("prompt logprobs"):
                        score_prompt(seq, start, n, logprobs[first : first + n])
                if seq.pending == 0:
                    advancing.append((seq, first + (n - 1 if scoring else 0)))
            except SequenceFault as fault:
                outputs.append(self.failed(seq, fault))
        outputs += self.advance([seq for seq, _ in advancing], self.sample(advancing, logprobs))
        # The step's drafts are judged at once, on the device, one copy to the host
        # (speculative.judge); rows the processors change, one sequence at a time as they leave them.
        judged = {} if self.processors else judged_together([(seq, first) for seq, _, first, _ in verifying], logprobs)
        outputs += [self._verify(seq, start, logprobs[first : first + n], judged.get(seq.id))
                    for seq, start, first, n in verifying]
        if self.drafter is not None:
            self.drafter.draft(spans, hidden)
        return outputs

    def forward(self, spans: list[tuple[Sequence, int, int]], rows: list[int],
                tokens: torch.Tensor | None = None, shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-probs at `rows` of a batch of (sequence, start, n) spans, and the hidden
        states of every token fed, in order. A graph replays only steps whose rows are all
        wanted (decode and verify spans: cuda_graphs.py); what it returns is valid until
        its next replay. `tokens`: the batch's inputs already on the device (a step
        launched ahead; drafts the drafter left there, speculative.fed_tokens). `shift`:
        each row's position past its span's, known on the device only (a drafted step
        launched ahead: drafts_ahead.py; graphs only)."""
        if self.blocks.ledger is not None:  # (the keys and erasures since the last forward, before it)
            self.blocks.ledger.flush()
        if tokens is None and any(seq.draft_at is not None for seq, _, _ in spans):
            tokens = fed_tokens(spans, self.device)
        if self.graphs is not None and self.graphs.fits(spans):
            # A lazy start's bucket, at its first use: captured now, so that a busy engine
            # (never idle) does not pad its batches to the largest bucket for good.
            self._capture([self.graphs.bucket(fed_rows(spans))])
            return self.graphs.replay(spans, self.scratch_block, tokens, shift)
        if shift is not None:
            raise RuntimeError("a drafted step launched ahead does not fit the graphs (a bookkeeping fault)")
        dev = self.device
        if tokens is None:
            tokens = on_device([t for seq, start, n in spans for t in seq.tokens(start, start + n)], dev)
        meta = AttentionMeta.build([(start, n, seq.blocks) for seq, start, n in spans], self.blocks.block_size, dev)
        prompt_graphs = self.prompt_graphs
        if prompt_graphs is not None and self.drafter is None and prompt_graphs.fits(len(tokens)):
            hidden = prompt_graphs.forward(tokens, meta, self.cache, self.scratch_block * self.blocks.block_size)
        else:
            hidden = self.model.forward(tokens, meta, self.cache)
        # (indices queued behind the forward: a copy from pageable memory would wait for it, and the
        # GPU would idle through each launch after it, the head, sampling, until the tokens' copy)
        picked = hidden if rows == list(range(len(hidden))) else hidden[on_device(rows, dev, torch.long)]
        return self.model.logits(picked).log_softmax(-1), hidden

    def _verify(self, seq: Sequence, start: int, rows: torch.Tensor, judged: list[int] | None) -> Output:
        """Keep what the target agrees with of `seq`'s drafts (speculative.accept) and the
        token after them; the pending token and the kept drafts are computed now. `judged`:
        those tokens, where already known (the step's drafts judged together)."""
        outs = []
        try:
            tokens = judged
            if tokens is None:
                # Row j follows the pending token and j drafts: the operator's processors see those
                # as generated, and shape the row before the drafts are judged on it.
                rows = self.processed(rows, [seq] * len(rows), [seq.output + seq.drafts[:j] for j in range(len(rows))])
                with stage("speculative decoding"):
                    tokens = accept(rows, seq)
            self.drafter.drafted += len(seq.drafts)
            seq.keep_drafts(0)
            seq.computed = start + len(tokens)
            self.blocks.cache_full_blocks(seq)
            self.drafter.accepted += len(tokens) - 1
            for token in tokens:
                outs.append(self._advance(seq, token, None, None))
                if seq.finished:
                    break
        except SequenceFault as fault:
            outs.append(self.failed(seq, fault))
        return Output.merge(outs)

    def failed(self, seq: Sequence, fault: SequenceFault) -> Output:
        """`seq` ends with its fault (faults.py); the others go on."""
        self.scheduler.finish(seq, "error")
        return Output(seq.id, error=str(fault), refused=fault.refused)

    def advance(self, seqs: list[Sequence], drawn: list) -> list[Output]:
        """An Output for each of `seqs` with what `sample` drew for it (or its fault)."""
        outputs = []
        for seq, d in zip(seqs, drawn):
            try:
                if isinstance(d, SequenceFault):
                    raise d
                outputs.append(self._advance(seq, *d))
            except SequenceFault as fault:
                outputs.append(self.failed(seq, fault))
        return outputs

    def sample(self, advancing: list[tuple[Sequence, int]], logprobs: torch.Tensor) -> list:
        """For each (sequence, row): (token, its log-prob, its top log-probs) as the request
        asked for them, drawn for the whole batch at once; if that fails, row by row, so
        that a failure is the one sequence's whose row it is (a SequenceFault in its place)."""
        if not advancing:
            return []
        seqs = [seq for seq, _ in advancing]
        picked = [row for _, row in advancing]
        # Every row (a decode step): no index at all; else one queued behind the step (model/host_values.py).
        rows = logprobs if picked == list(range(len(logprobs))) else logprobs[on_device(picked, self.device)]
        # Sampled from the rows as the operator's processors and the requests steer them; the
        # log-probs reported are the model's.
        try:
            with stage("sampling"):
                steered = steer(self.processed(rows, seqs), [s.params for s in seqs], [s.prompt for s in seqs],
                                [s.output for s in seqs], self.stop_ids, [s.matcher for s in seqs])
                generators = [s.generator_at(len(s.output)) for s in seqs]
                tokens = sample_batch(steered, [s.params for s in seqs], generators, [s.output for s in seqs])
                return drawn_on_host(seqs, rows, tokens)
        except SequenceFault:
            pass  # whose? each row on its own tells
        drawn = []
        for seq, row in zip(seqs, rows):
            try:
                with stage("sampling"):
                    steered = steer(self.processed(row[None], [seq]), [seq.params], [seq.prompt], [seq.output],
                                    self.stop_ids, [seq.matcher])[0]
                    token = sample(steered, seq.params, seq.generator_at(len(seq.output)), seq.output)
                    drawn += drawn_on_host([seq], row[None], on_device([token], self.device))
            except SequenceFault as fault:
                drawn.append(fault)
        return drawn

    def processed(self, rows: torch.Tensor, seqs: list[Sequence], outputs: list[list[int]] | None = None) -> torch.Tensor:
        """The rows after the operator's logits processors (on a copy: `rows` are reported);
        `outputs`: each row's tokens so far, where they are not its sequence's output."""
        if not self.processors:
            return rows
        with stage("logits processors"):
            return apply_processors(self.processors, rows.clone(),
                                    Batch([s.prompt for s in seqs], outputs or [s.output for s in seqs]))

    def _drafter_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """A drafter's logits as the processors shape them before drafts are drawn (as
        log-probs, the form processors take): a token they ban is never proposed."""
        return self.processed(logits.float().log_softmax(-1), seqs, [s.output + s.drafts for s in seqs])

    def _advance(self, seq: Sequence, token: int, logprob: float | None, top: dict[int, float] | None) -> Output:
        """Append the token drawn for `seq`; say what it adds."""
        seq.output.append(token)
        return self.took(seq, len(seq.output) - 1, token, logprob, top)

    def took(self, seq: Sequence, index: int, token: int, logprob: float | None, top: dict[int, float] | None) -> Output:
        """`token`, drawn for `seq`, is its output token `index` (the last, or the placeholder a
        step launched ahead booked there: pipeline.py); say what it adds."""
        p = seq.params
        seq.output[index] = token
        out = Output(seq.id, [token])
        if index == 0:
            out.cached_tokens = seq.cached_tokens
        if index == 0 and seq.prompt_logprobs is not None:
            out.prompt_logprobs, out.prompt_ranks = list(seq.prompt_logprobs), list(seq.prompt_ranks)
            if seq.prompt_top_logprobs is not None:
                out.prompt_top_logprobs = list(seq.prompt_top_logprobs)
        if p.logprobs is not None:
            out.logprobs.append(logprob)
            seq.logprobs.append(logprob)
            if top is not None:
                out.top_logprobs.append(top)
                seq.top_logprobs.append(top)
        if seq.matcher is not None:
            with stage("structured output"):
                consumed = seq.matcher.consume_token(token)
            if not consumed:
                raise GrammarRefused(f"at output token {len(seq.output)} ({token}): {seq.matcher.get_error().splitlines()[0]}")
        reason = self._finish_reason(seq, index, token)
        if reason is not None:
            del seq.output[index + 1 :]  # (placeholders a step launched after this one booked)
            self.scheduler.finish(seq, reason)
            out.finish_reason = reason
        return out

    def _finish_reason(self, seq: Sequence, index: int, token: int) -> str | None:
        """Whether `token`, output token `index`, ends `seq` by itself (stop strings are judged
        on the text, by whoever reads it: output_text.py)."""
        p = seq.params
        if (token in self.stop_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if seq.matcher is not None and seq.matcher.is_stopped():  # the grammar is complete: nothing may follow
            return "stop"
        if index + 1 >= p.max_tokens:
            return "length"
        return None
