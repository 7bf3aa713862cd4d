"""What a request reads of its sequence: the engine's Outputs (token ids, log-probs, a
finish reason) made into text a token at a time (detokenizer.py) and cut at the first
stop string (stop_strings.py).

This is the request's side of generation, apart from the engine: it needs the tokenizer
and the request, never the model, so it runs where the request is answered (the HTTP
process, or `LLM.generate`) while the engine computes the next step; an engine that died
takes nothing of it along (vLLM v1's output processor plays this part).

A stop string ends the request where its text is found: the Output is cut after the
token that completed it and marked finished ("stop"); whoever drives the engine then
aborts the sequence there, which may have computed a token or two more meanwhile: they
are dropped here. The text ends before the stop string, and without the text of a stop
token (EOS, stop_token_ids), unless the request asks for them (include_stop_str_in_output,
as vLLM's). What fails here is the request's own (faults.stage): it ends that
request alone.
"""

from __future__ import annotations

from dataclasses import replace

from preload.checkpoint.tokenizer import Tokenizer
from preload.worker.engine.detokenizer import Detokenizer
from preload.worker.engine.faults import SequenceFault, stage
from preload.worker.engine.output import Output
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence
from preload.worker.engine.stop_strings import StopStrings


class OutputText:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.detokenizer = Detokenizer(tokenizer, params.skip_special_tokens)
        self.stop_strings = StopStrings(params.stop, params.include_stop_str_in_output)
        # Tokens whose text a stop leaves out (the engine ends a sequence at them)
        self.stop_tokens = frozenset() if params.include_stop_str_in_output else (
            frozenset(params.stop_token_ids) | ({tokenizer.eos_id} - {None}))
        self.tokens: list[int] = []  # the output so far whose text is shown
        self.finished = False

    def add(self, out: Output) -> Output:
        """`out` with the text its tokens complete; cut at a stop string (finish_reason
        "stop"). Raises SequenceFault (detokenizing, stop strings) for its own failures.
        Nothing is added once finished: an Output then says only that (empty)."""
        if self.finished:
            return Output(out.seq_id, finish_reason="stop")
        if out.error is not None:
            self.finished = True
            return out
        pieces = []
        for i, token in enumerate(out.token_ids):
            last = out.finish_reason is not None and i == len(out.token_ids) - 1
            if last and out.finish_reason == "stop" and token in self.stop_tokens:
                token = None  # (a stop token: its text is not shown)
            else:
                self.tokens.append(token)
            released, stopped = self._release(token, last)
            pieces.append(released)
            if stopped:
                self.finished = True
                keep = i + 1
                return replace(out, token_ids=out.token_ids[:keep], logprobs=out.logprobs[:keep],
                               top_logprobs=out.top_logprobs[:keep], text="".join(pieces), finish_reason="stop")
        if out.finish_reason is not None and not out.token_ids:  # (finished without a token: the text's end)
            pieces.append(self._release(None, True)[0])
        self.finished = out.finish_reason is not None
        return replace(out, text="".join(pieces))

    def _release(self, token: int | None, last: bool) -> tuple[str, bool]:
        with stage("detokenizing"):
            new = self.detokenizer.add(token) if token is not None else ""
            if last:
                new += self.detokenizer.finish(self.tokens)
        with stage("stop strings"):
            return self.stop_strings.release(new, last=last)


def with_text(engine, texts: dict[int, tuple[Sequence, OutputText]], outputs: list[Output]) -> list[Output]:
    """A step's Outputs with their text, for a caller that steps `engine` itself
    (`LLM.generate`, tests): `texts` holds each sequence and its OutputText by id; a
    sequence a stop string (or its text's failure) ended is aborted in the engine, and
    what the engine says of it afterwards is dropped."""
    done = []
    for out in outputs:
        seq, text = texts[out.seq_id]
        if text.finished:
            continue
        try:
            shown = text.add(out)
        except SequenceFault as fault:
            text.finished = True
            shown = Output(out.seq_id, error=str(fault))
        if shown.finished and not out.finished:
            engine.abort(seq)
        done.append(shown)
    return done
