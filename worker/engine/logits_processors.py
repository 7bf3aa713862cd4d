"""Custom logits processors: the operator's code, applied to every request's logits.

An operator names processors when the worker starts (`--logits-processors
module:Class`, repeatable, optionally `module:Class={"json": "args"}`); never a request,
which could otherwise run code of its choosing (a request's `logits_processors` field is
refused). The interface:

    class MyProcessor:
        def __init__(self, context: ProcessorContext, **args): ...
        def __call__(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor: ...

`logits` are the rows [N, V] of the N sequences about to sample in this engine step, on
the engine's device (float32 log-probs, one row per sequence); return them changed (in
place or a new tensor, same shape). `batch` says whose rows they are. Processors run in
the order given, before the request's own steering (logit_bias, penalties, grammar) and
sampling; the log-probs a request asks for stay the model's. A processor that raises
fails the step's sequences, not the worker (the engine then tries each row alone).

`BanTokens` is the example: `--logits-processors
'preload.worker.engine.logits_processors:BanTokens={"token_ids": [13, 42]}'`.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor may need to know when it is made."""

    vocab_size: int
    device: torch.device
    stop_ids: frozenset[int]  # EOS and the model's other stop tokens


@dataclass(frozen=True)
class Batch:
    """Whose rows a processor sees: per row, the prompt and the tokens generated so far."""

    prompts: list[list[int]]
    outputs: list[list[int]]


LogitsProcessor = Callable[[torch.Tensor, Batch], torch.Tensor]


def load_processors(specs: tuple[str, ...], context: ProcessorContext) -> list[LogitsProcessor]:
    """Import and make each `module:Class` or `module:Class={json args}`; ValueError
    naming the spec when it cannot be."""
    made = []
    for spec in specs:
        path, _, args = spec.partition("=")
        module, _, name = path.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name) if module and name else None
            kwargs = json.loads(args) if args else {}
            if cls is None or not isinstance(kwargs, dict):
                raise ValueError("expected module:Class or module:Class={json object}")
            made.append(cls(context, **kwargs))
        except Exception as e:  # noqa: BLE001 - whatever the operator's code raises, say which spec
            raise ValueError(f"logits processor {spec!r}: {type(e).__name__}: {e}") from None
    return made


def apply_processors(processors: list[LogitsProcessor], logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    for processor in processors:
        out = processor(logits, batch)
        if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
            raise RuntimeError(f"logits processor {type(processor).__name__} returned "
                               f"{getattr(out, 'shape', type(out).__name__)}, not logits of shape {tuple(logits.shape)}")
        logits = out
    return logits


class BanTokens:
    """Never sample these token ids (e.g. a tokenizer's tokens the deployment must not emit)."""

    def __init__(self, context: ProcessorContext, token_ids: list[int]):
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < context.vocab_size)]
        if bad or not token_ids:
            raise ValueError(f"token_ids must be ids below {context.vocab_size}, got {token_ids!r}")
        self.ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=context.device)

    def __call__(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        return logits.index_fill(1, self.ids, float("-inf"))
