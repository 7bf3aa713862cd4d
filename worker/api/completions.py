"""POST /v1/completions: prompts (text or token ids) in, text out, whole or streamed."""

from __future__ import annotations

import time
from itertools import accumulate

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from preload.worker.api.logprobs import echoed_top_logprobs, prompt_logprobs_entries
from preload.worker.api.protocol import DEFAULT_MAX_TOKENS, CompletionRequest, Envelope, usage
from preload.worker.api.serving import Serving, serving
from preload.worker.api.streaming import event_stream
from preload.worker.engine.output import Output
from preload.worker.engine.sequence import Sequence

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(req: CompletionRequest, request: Request):
    s = serving(request)
    arrived = time.monotonic()
    s.admit(req, request)
    prompts = [s.encode(p, "prompt") if isinstance(p, str) else p for p in req.prompts_raw()]
    max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    # Scoring only still samples one token (the unit of the engine's work); it is not shown.
    params = [req.sampling(1 if req.score_only else max_tokens, req.logprobs, prompt_scores(req), choice=i)
              for i in range(req.n)]
    # n choices per prompt, a prompt's choices together (index = prompt * n + choice), as vLLM orders them.
    seqs = [Sequence(p, params[i]) for p in prompts for i in range(req.n)]
    streams = s.submit(seqs, arrived)
    choices = Choices(s, req, seqs)
    if req.stream:
        closing = choices.usage_chunk if req.include_usage else None
        return StreamingResponse(event_stream(streams, choices.chunk, closing=closing), media_type="text/event-stream")
    return choices.body(await s.collect(request, streams))


def prompt_scores(req: CompletionRequest) -> int | None:
    """How much of the prompt's log-probs to compute: as many top ones per token as
    prompt_logprobs asks; without it, for an echoed prompt with logprobs, as many as the
    output's (what lm-eval scores with). vLLM's order: prompt_logprobs governs both."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return req.logprobs if req.echo else None


class Choices:
    """A completion's choices as OpenAI writes them: whole (`body`) or a chunk per Output
    (`chunk`). With echo the prompt goes first, once; text_offset counts on across chunks."""

    def __init__(self, s: Serving, req: CompletionRequest, seqs: list[Sequence]):
        self.tokenizer, self.req, self.seqs = s.tokenizer, req, seqs
        self.envelope = Envelope.new("cmpl", s.model_name)
        self.echo_pending = [req.echo] * len(seqs)
        self.offsets = [0] * len(seqs)  # text_offset of each choice's next token
        self.generated = [0] * len(seqs)
        self.cached = [0] * len(seqs)  # prompt tokens the prefix cache held, per choice

    def chunk(self, i: int, out: Output) -> dict:
        choice = self._choice(i, out)
        return self.envelope("text_completion", [choice], **({"usage": self._usage()} if self.req.continuous_usage else {}))

    def usage_chunk(self) -> dict:
        return self.envelope("text_completion", [], usage=self._usage())

    def body(self, results: list[Output]) -> dict:
        choices = [self._choice(i, out) for i, out in enumerate(results)]
        return self.envelope("text_completion", choices, usage=self._usage())

    def _usage(self) -> dict:
        n = self.req.n
        return usage(sum(len(seq.prompt) for seq in self.seqs[::n]), sum(self.generated), sum(self.cached[::n]))

    def _choice(self, i: int, out: Output) -> dict:
        shown = not self.req.score_only
        ids = out.token_ids if shown else []
        text = out.text if shown else ""
        lps = out.logprobs if shown else []
        tops = [self._top(top) for top in out.top_logprobs] if shown and self.req.logprobs else [None] * len(ids)
        self.generated[i] += len(ids)
        if out.cached_tokens is not None:
            self.cached[i] = out.cached_tokens
        prompt = self.seqs[i].prompt
        if self.echo_pending[i]:
            self.echo_pending[i] = False
            text = self.tokenizer.decode(prompt) + text
            if out.prompt_logprobs is not None:  # (asked with logprobs: prompt_scores)
                ids, lps = prompt + ids, out.prompt_logprobs + lps
                tops = echoed_top_logprobs(self.tokenizer, prompt, out) + tops
        finish = "length" if self.req.score_only and out.finished else out.finish_reason
        choice = {"index": i, "text": text, "logprobs": self._logprobs(i, ids, lps, tops), "finish_reason": finish}
        if self.req.prompt_logprobs is not None and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_entries(self.tokenizer, prompt, out)
        return choice

    def _logprobs(self, i: int, ids: list[int], lps: list, tops: list) -> dict | None:
        if self.req.logprobs is None:
            return None
        texts = [self.tokenizer.token_text(t) for t in ids]
        starts = list(accumulate(map(len, texts), initial=self.offsets[i]))
        self.offsets[i] = starts.pop()
        return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": starts}

    def _top(self, top: dict[int, float]) -> dict[str, float]:
        return {self.tokenizer.token_text(t): lp for t, lp in top.items()}
