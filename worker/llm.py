"""`LLM`: the offline Python API. Loads a checkpoint in-process and generates."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from preload.checkpoint.config import ModelConfig
from preload.checkpoint.identity import IdentityError, verify_checkpoint
from preload.checkpoint.reader import resolve_dtype
from preload.checkpoint.tokenizer import Tokenizer
from preload.ipc.devices import resolve_device_name
from preload.kernels import ahead
from preload.kernels.attention import decode_kernel_takes
from preload.ipc.kv_memory import KvMemory
from preload.ipc.manifest import ArenaInfo
from preload.ipc.packed_weights import load_checkpoint
from preload.options import CPU_KV_CACHE_BYTES, QUANT_MODES, EngineOptions
from preload.worker.attach import attach
from preload.worker.engine.cuda_graphs import DecodeGraphs
from preload.worker.engine.engine import Engine
from preload.worker.engine.output import Output
from preload.worker.engine.output_text import OutputText, with_text
from preload.worker.engine.prompt_graphs import PromptGraphs, token_buckets
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence as Seq
from preload.worker.engine.speculative import SpecConfig
from preload.worker.model.deepseek import Transformer, Weights
from preload.worker.model.parallel import Ranks, rank_config, shard
from preload.worker.tensor_group import Leader

log = logging.getLogger("preload.worker")


@dataclass
class Completion:
    """One prompt's result. `prompt_logprobs[i]` is log p(prompt[i] | prompt[:i]),
    None for the first token; `logprobs[i]` that of the i-th generated token."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None  # "stop" (end of sequence, stop token or string) or "length"


class LLM:
    """A model ready to generate: loaded in this process (on the GPU when there is one,
    unless `device` says otherwise), or attached zero-copy to a running daemon's weights
    when `state_dir` is given (then `model`, `quant`, `device` and `dtype`, if given,
    must match what the daemon holds; `dp_rank`: which of its copies, one per GPU)."""

    def __init__(
        self,
        model: str | Path | None = None,
        quant: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        state_dir: str | Path | None = None,
        engine: EngineOptions | None = None,
        lazy_graphs: bool = False,
        ranks: Ranks = Ranks(),
        leader: Leader | None = None,
        dp_rank: int = 0,
    ):
        if quant is not None and quant not in QUANT_MODES:
            raise ValueError(f"quant {quant!r} not supported; choose one of {', '.join(QUANT_MODES)}")
        self.attached = None
        self._draft = None  # (what --speculative-config named, the draft model, its attachment or None)
        self.weights_let_go = False  # a spare kept through a sleep, between its release and its remap
        if state_dir is not None:
            weights = self._attach(state_dir, model, quant, device, dtype, dp_rank)
        elif model is None:
            raise ValueError("LLM needs a model directory or a daemon's state_dir")
        else:
            weights = self._load(Path(model), quant or "none", device or "auto", dtype)
        if self.device.type == "cuda":  # (so that another host's first start compiles them ahead: kernels/ahead.py)
            ahead.record()
        self.leader = leader  # rank 0 of a group of processes (tensor_group.py): its engines' steps are the group's
        ranks = leader.ranks if leader is not None else ranks
        if leader is not None and self.device.type == "cuda":
            raise ValueError("--tensor-parallel-size on a GPU (NCCL, a device per rank) is not built yet")
        if ranks.expert_parallel and self.device.type == "cuda":
            raise ValueError("expert parallelism on a GPU is not built yet (its grouped kernels take every expert)")
        # (`ranks`: one process of a tensor-parallel group, its share of the model: worker/model/parallel.py)
        self.model = Transformer(rank_config(self.config, ranks), shard(self.config, weights, ranks), ranks)
        self.graphs: DecodeGraphs | None = None
        self.prompt_graphs: PromptGraphs | None = None
        self.draft_graphs: DecodeGraphs | None = None  # the drafter's steps (--speculative-config)
        self._graph_layout: tuple | None = None  # what the decode graphs were made for
        self.lazy_graphs = lazy_graphs  # only the largest decode graph now, the rest as the engine idles
        self.engine: Engine | None = None
        engine = engine or EngineOptions()
        if engine.kv_cache_memory is None:
            engine = replace(engine, kv_cache_memory=CPU_KV_CACHE_BYTES)  # auto, in-process: a fixed budget
        self.start_engine(engine)

    def start_engine(self, config: EngineOptions, kv_memory: Callable[[int], KvMemory] | None = None) -> None:
        """(Re)build the engine and its KV cache (config.kv_cache_memory in bytes); the
        old engine's cache is freed first. On a GPU, unless config.enforce_eager, the
        decode steps are captured as CUDA graphs the first time, and kept for later
        engines of the same cache layout (only their cache's addresses change).
        `kv_memory`: where the cache lives (engine.Engine), for a supervised worker."""
        self._drop_engine()
        if self.leader is not None and config.speculative_config:
            raise ValueError("--speculative-config with --tensor-parallel-size is not built yet (drafts run eagerly apart)")
        draft = self._draft_model(config)
        spec = SpecConfig.parse(config.speculative_config)
        graphs = prompt_graphs = draft_graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            # (drafts ahead: graphs that move their rows on by a shift: cuda_graphs.shift_rows)
            layout = (config.block_size, config.kv_cache_dtype, config.speculative_config,
                      config.drafts_ahead and spec is not None)
            if self.graphs is None or self._graph_layout != layout or not self._graphs_follow_the_cache(draft):
                self.graphs, self.draft_graphs = self._decode_graphs(config, spec, draft)
                self._graph_layout = layout
                self.prompt_graphs = None  # (they write the cache through the decode graphs' address table)
            # (Prompts with a drafter run eagerly: it reads their hidden states, which pieces do not keep.)
            if spec is None and (self.prompt_graphs is None
                                 or self.prompt_graphs.sizes != token_buckets(config.max_num_batched_tokens)):
                self.prompt_graphs = PromptGraphs(self.model, config.max_num_batched_tokens, self.device)
            graphs, draft_graphs = self.graphs, self.draft_graphs
            prompt_graphs = self.prompt_graphs if spec is None else None
        # Prefix-cache keys name the weights: an attached worker's fingerprint (one process
        # never serves two sets of weights otherwise, and each engine has its own cache).
        fingerprint = self.attached.manifest.fingerprint if self.attached else "in-process"
        self.engine = Engine(self.model, self.tokenizer, config, self.device, graphs, fingerprint,
                             draft, kv_memory, prompt_graphs, draft_graphs)
        captures = [(graphs, self.engine.cache)] + ([(draft_graphs, self.engine.drafter.cache)] if draft_graphs else [])
        for g, cache in captures:
            if g is not None and not g.graphs:
                g.capture(cache, self.engine.scratch_block, g.sizes[-1:] if self.lazy_graphs else None)
        self.stop_ids = self.engine.stop_ids
        if self.leader is not None:
            self.leader.lead(self.engine)

    def _graphs_follow_the_cache(self, draft: Transformer | None) -> bool:
        """Whether graphs captured against one cache serve a later one (a spare's, captured
        against its warm-up cache, on its slot's): only where every decode attention runs
        the kernel that reads the cache's addresses from the graphs' table; a test model's
        odd shapes take torch's reference, which would go on reading the first cache."""
        return all(decode_kernel_takes(m.cfg.kv_lora_rank, m.cfg.qk_rope_head_dim) for m in (self.model, draft)
                   if m is not None)

    def _load(self, model_dir: Path, quant: str, device: str, dtype: str | None) -> Weights:
        self.config = ModelConfig.from_dir(model_dir)
        self.device = torch.device(resolve_device_name(device))
        self.dtype = resolve_dtype(dtype, self.device, self.config)
        self.quant = quant
        self.tokenizer = Tokenizer.from_dir(model_dir)
        return load_checkpoint(model_dir, self.config, self.dtype, self.device, quant)

    def _attach(self, state_dir, model, quant: str | None, device: str | None, dtype: str | None,
                dp_rank: int = 0) -> Weights:
        t = time.monotonic()
        self.attached = attach(state_dir, dp_rank=dp_rank)
        # (a start's timeline: on a GPU this is the CUDA context and the arena's import; the model's
        # build and first graph follow)
        log.info("the daemon's arena mapped in %.3f s", time.monotonic() - t)
        m = self.attached.manifest
        try:
            wanted = {"quant": quant, "dtype": dtype, "device": device and resolve_device_name(device)}
            for key, value in wanted.items():
                if value is not None and value != getattr(m, key):
                    raise IdentityError(f"the daemon on {state_dir} holds {key} {getattr(m, key)}, not {value}")
            if model is not None:
                verify_checkpoint(model, m.record)
        except BaseException:
            self.attached.close()
            raise
        files = self.attached.files
        self.config = ModelConfig.from_dict(self.attached.config)
        self.device, self.dtype, self.quant = torch.device(m.device), resolve_dtype(m.dtype, torch.device(m.device), self.config), m.quant
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # (Triton and graphs launch on the current device: the arena's)
        self.tokenizer = Tokenizer(files["tokenizer.json"].decode(), json.loads(files.get("tokenizer_config.json", b"{}")))
        return self.attached

    def _decode_graphs(self, config: EngineOptions, spec: SpecConfig | None,
                       draft: Transformer | None) -> tuple[DecodeGraphs, DecodeGraphs | None]:
        """The decode graphs for engines of `config`, and the drafter's: a verify step feeds
        each sequence's pending token and its k drafts (rows, cuda_graphs.py); the MTP layer
        catches up on up to k + 1 positions a sequence, a draft model on one more, and the
        drafter's graphs are filled k times a step (the catch-up, then each chained draft)."""
        def made(model: Transformer, rows: int, **kw) -> DecodeGraphs:
            return DecodeGraphs(model, rows, config.block_size, config.kv_cache_dtype, self.device, **kw,
                                shifted=spec is not None and config.drafts_ahead)

        if spec is None:
            return made(self.model, config.max_num_seqs), None
        k = spec.num_speculative_tokens
        rows = config.max_num_seqs * (k + 1)
        if spec.method == "mtp":
            target = made(self.model, rows, cache_layers=self.model.num_cache_layers)
            return target, made(self.model, rows, cache_ptrs=target.cache_ptrs, mtp=True, fills=k)
        return made(self.model, rows), made(draft, rows + config.max_num_seqs, fills=k)

    def _draft_model(self, config: EngineOptions) -> Transformer | None:
        """The draft model --speculative-config names: loaded here, on the target's device and
        in its dtype, or attached zero-copy to the daemon of its state_dir; kept for later engines."""
        spec = SpecConfig.parse(config.speculative_config)
        if spec is None or spec.method != "draft_model":
            return None
        key = (spec.model, spec.state_dir)
        if self._draft is None or self._draft[0] != key:
            if self._draft is not None and self._draft[2] is not None:
                self._draft[2].close()
            attached = None
            if spec.state_dir:
                attached = attach(spec.state_dir)
                if attached.manifest.device != str(self.device):
                    attached.close()
                    raise ValueError(f"the draft model's daemon holds it on {attached.manifest.device}, not {self.device}")
                cfg, weights = ModelConfig.from_dict(attached.config), attached
            else:
                cfg = ModelConfig.from_dir(Path(spec.model))
                weights = load_checkpoint(Path(spec.model), cfg, self.dtype, self.device, "none")
            self._draft = (key, Transformer(cfg, weights), attached)
        return self._draft[1]

    def _drop_engine(self) -> None:
        memory = self.engine.kv_memory if self.engine is not None else None
        self.engine = None
        if memory is not None:
            memory.close()

    def let_go_of_weights(self) -> None:
        """A spare kept through a level-1 sleep (preloadd/sleeping.py): the daemon's arena
        let go, its addresses kept (map_weights_again at the wake), and what the allocator
        keeps unused. Its context and graphs stay: a spare that dropped its prompt steps'
        graphs (0.4 GiB on V2-Lite) recaptured a bucket for its first request after the
        wake, 0.5 s on an H100 that a kept one answers in 0.01 s."""
        if self.attached is None or self.leader is not None or (self._draft is not None and self._draft[2] is not None):
            raise RuntimeError("only a worker mapping one daemon's weights alone can be kept through a sleep")
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        self.attached.let_go_of_memory()
        self.weights_let_go = True
        log.info("kept through a sleep: the weights let go; %.0f MiB held by torch's allocator (%.0f before)",
                 torch.cuda.memory_reserved(self.device) / 2**20, before / 2**20)

    def map_weights_again(self, info: ArenaInfo, fds: list[int], fingerprint: str) -> None:
        self.attached.map_again(info, fds, fingerprint)
        self.weights_let_go = False

    def close(self) -> None:
        self._drop_engine()
        if self.leader is not None:
            self.leader.close()
        if self._draft is not None and self._draft[2] is not None:
            self._draft[2].close()
        if self.attached is not None:
            self.attached.close()

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        logprobs: bool | int = False,
        prompt_logprobs: bool | int = False,
        **sampling,
    ) -> list[Completion]:
        """Generate for every prompt together (continuous batching). `logprobs`: True
        for the chosen tokens' log-probs, an int n for the n most likely as well
        (`Completion.top_logprobs`); `prompt_logprobs` likewise, for the prompt's tokens
        (`Completion.prompt_top_logprobs`). Further SamplingParams fields (top_k, stop, ...)
        pass through `sampling`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        n_top = None if logprobs is False else (0 if logprobs is True else int(logprobs))
        n_prompt = None if prompt_logprobs is False else (0 if prompt_logprobs is True else int(prompt_logprobs))
        params = SamplingParams(max_tokens, temperature, top_p, seed=seed, logprobs=n_top,
                                prompt_logprobs=n_prompt, **sampling)
        seqs = [Seq(self._prompt_ids(p), params) for p in prompts]
        for seq in seqs:  # all of them before any is queued
            self.engine.check(seq)
        for seq in seqs:
            self.engine.add(seq)
        texts = {seq.id: (seq, OutputText(self.tokenizer, params)) for seq in seqs}
        outputs: dict[int, list[Output]] = {seq.id: [] for seq in seqs}
        while self.engine.has_work():
            for out in with_text(self.engine, texts, self.engine.step()):
                outputs[out.seq_id].append(out)
        results = [Output.merge(outputs[seq.id]) for seq in seqs]
        failed = [f"prompt {i}: {r.error}" for i, r in enumerate(results) if r.error is not None]
        if failed:
            raise RuntimeError("; ".join(failed))
        return [
            Completion(
                prompt_token_ids=seq.prompt,
                token_ids=result.token_ids,
                text=result.text,
                logprobs=result.logprobs if n_top is not None else None,
                top_logprobs=result.top_logprobs if n_top else None,
                prompt_logprobs=seq.prompt_logprobs,
                prompt_top_logprobs=seq.prompt_top_logprobs,
                finish_reason=result.finish_reason,
            )
            for seq, result in zip(seqs, results)
        ]
