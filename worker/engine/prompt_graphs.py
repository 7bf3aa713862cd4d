"""Steps that carry prompt tokens, replayed piecewise from CUDA graphs.

Eagerly, a step of 2,048 tokens launches about 1,100 kernels on V2-Lite's shapes, and on
an H200 launching them takes longer than running them: 26-29 ms of GPU work in a step of
45 ms and more (docs/performance.md, "Prefill and mixed serving"). What attention does
depends on the step's layout (its sequences, their contexts, which rows are decode rows),
which a graph would bake in; everything else (norms, projections, rope, cache writes,
routing, the experts) depends only on how many tokens the step has. So, as vLLM's
piecewise graphs do, a step is padded up to a bucket of tokens, and each bucket has the
N + 1 pieces between a model's N attentions captured as graphs: a step replays piece 0
(embedding, layer 0 up to attending), layer 0's attention eagerly, piece 1 (layer 0 from
its attention's output, layer 1 up to attending), ..., piece N (the last layer's end and
the final norm). About 28 graph launches and a few attention kernels a layer.

The pieces talk through buffers of fixed address: the inputs (tokens, positions, cache
slots), the queries a piece leaves for the attention after it, the attention's output the
next piece reads, and the residual stream. Rows past the step's tokens (padding) take
token 0 at position 0 and write their latents to the scratch block, which the engine
never hands out; outside attention every operation treats rows apart, and attention runs
on the real rows only, so padding changes nothing real. The model's eager forward
(`Transformer.forward`) is the reference these replays are tested against.
"""

from __future__ import annotations

import logging
import time

import torch

from preload.kernels.norm import add_rms_norm
from preload.worker.engine.cuda_graphs import captured
from preload.worker.model.deepseek import Transformer
from preload.worker.model.kv_cache import AttentionMeta, LatentCache

log = logging.getLogger(__name__)

BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144,
           7168, 8192)


def token_buckets(max_tokens: int) -> list[int]:
    """The step sizes captured: BUCKETS below max_tokens (the token budget of a step), and
    max_tokens itself, at most the last bucket (a larger step runs eagerly: its launches
    cost little beside its work)."""
    max_tokens = min(max_tokens, BUCKETS[-1])
    return [b for b in BUCKETS if b < max_tokens] + [max_tokens]


class PromptGraphs:
    """The captured pieces of one model's steps, per bucket of tokens: `forward` runs a
    step of up to the largest bucket's tokens, capturing its bucket at first use."""

    def __init__(self, model: Transformer, max_tokens: int, device: torch.device):
        cfg, dtype = model.cfg, model.embed.dtype
        self.model = model
        self.sizes = token_buckets(max_tokens)
        n, h = self.sizes[-1], cfg.num_heads
        self.inputs = torch.zeros(3, n, dtype=torch.long, device=device)  # tokens, positions, cache slots
        self.q_nope = torch.zeros(n, h, cfg.qk_nope_head_dim, dtype=dtype, device=device)
        self.q_pe = torch.zeros(n, h, cfg.qk_rope_head_dim, dtype=dtype, device=device)
        self.attended = torch.zeros(n, h, cfg.v_head_dim, dtype=dtype, device=device)
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each bucket's last piece's output: the final-normed states
        self.partial: dict[int, list[torch.cuda.CUDAGraph]] = {}  # buckets whose pieces are being captured
        self.seconds: dict[int, float] = {}  # each bucket's capture time
        self.failed: set[int] = set()  # buckets whose capture failed: they run eagerly
        self.pool = None  # the captures' shared memory pool (pieces and buckets never run at once)

    def fits(self, tokens: int) -> bool:
        return tokens <= self.sizes[-1] and self.bucket(tokens) not in self.failed

    def bucket(self, tokens: int) -> int:
        return next(s for s in self.sizes if s >= tokens)

    @property
    def pending(self) -> list[int]:
        """The buckets not captured yet (nor failed), smallest first."""
        return [s for s in self.sizes if s not in self.graphs and s not in self.failed]

    def forward(self, tokens: torch.Tensor, meta: AttentionMeta, cache: LatentCache, scratch_slot: int) -> torch.Tensor:
        """Final-normed hidden states [T, D] of a step's tokens [T] (as Transformer.forward),
        valid until the next step. Its bucket is captured first if it is not yet."""
        t = len(tokens)
        size = self.bucket(t)
        if size not in self.graphs and not self.capture(size, cache, scratch_slot):
            return self.model.forward(tokens, meta, cache)
        self._fill(tokens, meta, t, size, scratch_slot)
        pieces = self.graphs[size]
        q_nope, q_pe, attended = self.q_nope[:t], self.q_pe[:t], self.attended[:t]  # (views made once a step)
        for layer, piece in zip(self.model.layers, pieces):
            piece.replay()
            layer.attn.attend(q_nope, q_pe, meta, cache, out=attended)
        pieces[-1].replay()
        return self.hidden[size][:t]

    def _fill(self, tokens: torch.Tensor, meta: AttentionMeta | None, t: int, size: int, scratch_slot: int) -> None:
        inputs = self.inputs
        if t:
            inputs[0, :t].copy_(tokens)
            inputs[1, :t].copy_(meta.positions)
            inputs[2, :t].copy_(meta.slots)
        inputs[:2, t:size].zero_()
        inputs[2, t:size].fill_(scratch_slot)

    def _piece(self, i: int, size: int, cache: LatentCache) -> torch.Tensor | None:
        """Piece i of a step of `size` tokens: layer i-1 from its attention's output, then
        layer i up to attending (its queries and residual left in the buffers); the last
        piece ends with the final norm and returns the hidden states."""
        m = self.model
        tokens, positions, slots = self.inputs[:, :size]
        if i == 0:
            x, residual = m.embed[tokens], None
        else:
            x, residual = m.layers[i - 1].after_attention(self.attended[:size].flatten(1), self.residual[:size])
        if i == len(m.layers):
            return add_rms_norm(x, residual, m.norm, m.cfg.rms_norm_eps)[0]
        q_nope, q_pe, residual = m.layers[i].before_attention(x, residual, m.rope, positions, slots, cache)
        self.q_nope[:size].copy_(q_nope)
        self.q_pe[:size].copy_(q_pe)
        self.residual[:size].copy_(residual)
        return None

    @torch.inference_mode()
    def capture(self, size: int, cache: LatentCache, scratch_slot: int, most: int | None = None) -> bool:
        """Capture a bucket's pieces, or only `most` more of them (an idle engine captures
        a few at a time, so that a request arriving meanwhile waits little); True once the
        bucket is whole. Each piece runs once eagerly first: that compiles its kernels and
        makes what the model makes lazily. A capture that fails leaves the bucket to run
        eagerly, with a warning: slower, never wrong."""
        t0 = time.monotonic()
        pieces = self.partial.setdefault(size, [])
        last = len(self.model.layers) + 1
        todo = range(len(pieces), last if most is None else min(last, len(pieces) + most))
        self._fill(None, None, 0, size, scratch_slot)  # (every row padding: writes only the scratch block)
        try:
            for i in todo:
                graph, out = captured(lambda: self._piece(i, size, cache), self.pool)
                self.pool = graph.pool()
                pieces.append(graph)
        except RuntimeError as e:
            log.warning("steps of %d tokens not captured (%s); they run eagerly", size, e)
            self.failed.add(size)
            del self.partial[size]
            return False
        torch.cuda.synchronize()
        self.seconds[size] = self.seconds.get(size, 0.0) + time.monotonic() - t0
        if len(pieces) < last:
            return False
        self.graphs[size], self.hidden[size] = self.partial.pop(size), out
        log.info("captured steps of %d tokens (%d pieces) in %.2f s", size, last, self.seconds[size])
        return True
