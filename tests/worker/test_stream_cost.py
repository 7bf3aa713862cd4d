"""A stream of n tokens costs O(n) decoding work, wherever it happens (the engine thread
or the event loop): counted in token ids handed to the tokenizer, never timed.

The detokenizer alone, over 4,000 tokens of text and over runs that give no text (which
make the library's DecodeStream re-decode what it holds); and a whole /v1/completions
stream of 4,000 tokens through the real app, engine thread and SSE, in-process, with a
scripted model so that the 4,000 steps take a second or two.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from tokenizers.decoders import DecodeStream
from workers import sse_data

from preload import BUNDLED_MODEL
from preload.checkpoint.config import ModelConfig
from preload.checkpoint.tokenizer import Tokenizer
from preload.options import EngineOptions
from preload.worker.api.app import create_app
from preload.worker.api.state import WorkerState
from preload.worker.engine import detokenizer as detokenizer_module
from preload.worker.engine.async_engine import AsyncEngine
from preload.worker.engine.detokenizer import Detokenizer
from preload.worker.engine.engine import Engine

N = 4000
TEXT = "def f(x):\n    return '日本🎉' * x  # ünïcödé\n"


class CountingStream:
    """DecodeStream, counting the token ids it decodes: at each step the ids it holds
    (as tokenizers' step_decode_stream keeps them), and when it gives text, again those
    it keeps for the next step."""

    decoded = 0

    def __init__(self, **kw):
        self.stream, self.held, self.prefix_index = DecodeStream(**kw), 0, 0

    def step(self, tokenizer, ids):
        self.held += len(ids)
        CountingStream.decoded += self.held
        text = self.stream.step(tokenizer, ids)
        if text is not None:
            self.held = self.prefix_index = self.held - self.prefix_index
            CountingStream.decoded += self.held
        return text


@pytest.fixture
def count_decoding(monkeypatch):
    """Counts every token id decoded from now on; returns a function giving the total."""
    monkeypatch.setattr(detokenizer_module, "DecodeStream", CountingStream)
    CountingStream.decoded = 0
    ours = {"ids": 0}
    for name in ("decode", "token_text"):
        real = getattr(Tokenizer, name)

        def counting(self, ids, *args, real=real):
            ours["ids"] += len(ids) if isinstance(ids, list) else 1
            return real(self, ids, *args)

        monkeypatch.setattr(Tokenizer, name, counting)
    return lambda: CountingStream.decoded + ours["ids"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(BUNDLED_MODEL)


@pytest.mark.parametrize("run", ["text", "special tokens", "bytes that never form a character"])
def test_the_detokenizer_decodes_o_of_n_token_ids(tok, count_decoding, run):
    ids = {
        "text": (tok.encode(TEXT, add_special_tokens=False) * N)[:N],
        "special tokens": [tok.eos_id] * N,
        "bytes that never form a character": [tok.encode("日", add_special_tokens=False)[0]] * N,
    }[run]
    want = tok.decode(ids)
    before = count_decoding()
    d = Detokenizer(tok)
    text = "".join(d.add(t) for t in ids) + d.finish(ids)
    decoded = count_decoding() - before
    print(f"{run}: {decoded} token ids decoded for {N} tokens")
    # A step decodes the few tokens since the previous text, twice when it gives text;
    # decoding the whole output at every token would be ~N^2 / 2 = 8,000,000.
    assert decoded <= 8 * N
    assert text == want


class ScriptedModel:
    """Stands in for the Transformer: whatever the input, the next token is the next of
    `script` (by greedy sampling), at no cost."""

    def __init__(self, cfg: ModelConfig, script: list[int]):
        self.cfg, self.script, self.k = cfg, script, 0
        self.embed = torch.zeros(1)  # the engine reads its dtype

    def forward(self, tokens, meta, cache) -> torch.Tensor:
        return torch.zeros(len(tokens), 1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = torch.zeros(len(hidden), self.cfg.vocab_size)
        rows[-1, self.script[self.k % len(self.script)]] = 1.0  # one sequence: its row is the last
        self.k += 1
        return rows


@pytest.fixture
def scripted_app(tok):
    """The worker's app around an engine that decodes TEXT (and an end-of-text token) over and over."""
    script = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_id]
    cfg = ModelConfig.from_dir(BUNDLED_MODEL)
    engine = Engine(ScriptedModel(cfg, script), tok, EngineOptions(kv_cache_memory=16 << 20), torch.device("cpu"))
    assert engine.max_model_len >= N + 2
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, tok, "scripted", WorkerState(phase="ready"))
    return app, async_engine, [script[k % len(script)] for k in range(N)]


def post(app, async_engine, body: dict) -> httpx.Response:
    async def main():
        async_engine.start(asyncio.get_running_loop())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as c:
                return await c.post("/v1/completions", json=body, timeout=300)
        finally:
            async_engine.stop()

    return asyncio.run(main())


def test_a_4000_token_stream_costs_o_of_n(scripted_app, tok, count_decoding):
    app, async_engine, expected = scripted_app
    body = {"prompt": [5, 6], "max_tokens": N, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 1}
    r = post(app, async_engine, body)
    assert r.status_code == 200, r.text
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d)["choices"][0] for d in data[:-1]]
    assert "".join(c["text"] for c in chunks) == tok.decode(expected)
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == N
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and offsets[0] == 0  # counted on across chunks
    decoded = count_decoding()
    print(f"a {N}-token stream decoded {decoded} token ids")
    # Detokenizing (< 8 per token, see above) and a chosen and a top token's text per token.
    assert decoded <= 10 * N


def test_a_request_is_checked_once_per_sequence(scripted_app, monkeypatch):
    app, async_engine, _ = scripted_app
    checked = []
    real = Engine.check
    monkeypatch.setattr(Engine, "check", lambda self, seq: (checked.append(seq.id), real(self, seq))[1])
    r = post(app, async_engine, {"prompt": [[5, 6], [7]], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(checked) == len(set(checked)) == 2
