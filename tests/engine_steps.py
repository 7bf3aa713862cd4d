"""Driving an engine by hand, as the worker's engine thread does: step until its work is
done, collecting each sequence's Outputs; workloads to drive it with; the options of an
engine that drafts."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

from preload import BUNDLED_MODEL
from preload.options import EngineOptions
from preload.worker.engine.grammar import regex_grammar
from preload.worker.engine.output import Output
from preload.worker.engine.output_text import OutputText, with_text
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence

LOGPROBS = 10  # the index of mixed_requests' one request asking for log-probs
DRAFT_MODEL = str(Path(BUNDLED_MODEL).parent / "tiny-v3-draft")


def run_to_end(engine, seqs: list[Sequence], each_step=None) -> dict[int, Output]:
    """Add `seqs` (checked first) and step `engine` until it has no work; each sequence's
    merged Output by id, with its text (output_text.py). `each_step(outputs)`: called after
    every step with the Outputs so far (it may add sequences: give them a list in `outputs`
    first; they get their text too)."""
    for seq in seqs:
        engine.check(seq)
        engine.add(seq)
    texts = {seq.id: (seq, OutputText(engine.tokenizer, seq.params)) for seq in seqs}
    outputs: dict[int, list[Output]] = {seq.id: [] for seq in seqs}
    while engine.has_work():
        for seq in engine.scheduler.waiting:  # (where each_step's additions are, before their first step)
            texts.setdefault(seq.id, (seq, OutputText(engine.tokenizer, seq.params)))
        for out in with_text(engine, texts, engine.step()):
            outputs[out.seq_id].append(out)
        if each_step is not None:
            each_step(outputs)
    return {seq.id: Output.merge(outputs[seq.id]) for seq in seqs}


def mixed_requests(seed: int) -> list[Sequence]:
    """Twelve requests of 1 to 40 prompt tokens, some sharing prefixes of one another, and 1
    to 40 output tokens: greedy ones stopping on many tokens, seeded sampled ones,
    penalized ones, one under a grammar, one asking for log-probs (at LOGPROBS); the same
    ones for the same `seed`."""
    gen = random.Random(seed)
    base = [gen.randrange(5, 200) for _ in range(24)]
    seqs = []
    for i in range(12):
        prompt = base[: gen.randrange(0, 24)] + [gen.randrange(5, 200) for _ in range(gen.randrange(1, 17))]
        params = {"max_tokens": gen.randrange(1, 41), "ignore_eos": True}
        if i % 3 == 0:
            params |= {"stop_token_ids": list(range(3, 1000, 7))}
        if i % 4 == 1:
            params |= {"temperature": 0.8, "seed": i}
        if i % 5 == 2:
            params |= {"frequency_penalty": 1.5, "repetition_penalty": 1.5}
        if i == 7:
            params |= {"grammar": regex_grammar("[a-z ]+")}
        if i == LOGPROBS:
            params |= {"logprobs": 2}
        seqs.append(Sequence(prompt, SamplingParams(**params)))
    return seqs


def ending_in_turn(**params) -> list[Sequence]:
    """Six requests of 3 to 30 prompt tokens, ending one after another (batches of 6 down to
    1), the longest first; greedy unless `params` say otherwise."""
    return [Sequence(list(range(10 + 7 * i, 13 + 12 * i)),
                     SamplingParams(**({"max_tokens": 4 + 5 * i, "ignore_eos": True} | params)))
            for i in reversed(range(6))]


def speculating(config: EngineOptions, method: str, k: int) -> EngineOptions:
    """`config` drafting k tokens a step with the bundled model's MTP layer or its draft model."""
    spec = {"method": method, "num_speculative_tokens": k} | ({"model": DRAFT_MODEL} if method == "draft_model" else {})
    return replace(config, speculative_config=json.dumps(spec))
