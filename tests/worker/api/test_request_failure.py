"""When a request's own work fails inside the engine (here: its sampling, made to raise),
that request alone is answered with a server error naming the stage, whole or as an
error event in its stream, and the worker goes on serving everyone else. In-process:
the real app, engine thread and bundled model, driven through ASGI; and the offline
`LLM.generate`, which raises."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from workers import sse_data

from preload import BUNDLED_MODEL, LLM
from preload.worker.api.app import create_app
from preload.worker.api.state import WorkerState
from preload.worker.engine import engine as engine_module
from preload.worker.engine.async_engine import AsyncEngine

DOOMED_SEED = 666  # the requests whose sampling fails
GOOD = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
DOOMED = GOOD | {"temperature": 1.0, "seed": DOOMED_SEED}


@pytest.fixture(scope="module")
def llm():
    return LLM(BUNDLED_MODEL, dtype="float32")


@pytest.fixture
def doomed_sampling(monkeypatch):
    """Sampling fails for a batch that holds a doomed row, and for that row alone."""
    real_batch, real_row = engine_module.sample_batch, engine_module.sample

    def fail() -> None:
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    def sample_batch(logits, params, generators, generated):
        if any(p.seed == DOOMED_SEED for p in params):
            fail()
        return real_batch(logits, params, generators, generated)

    def sample(logits, params, generator, generated):
        if params.seed == DOOMED_SEED:
            fail()
        return real_row(logits, params, generator, generated)

    monkeypatch.setattr(engine_module, "sample_batch", sample_batch)
    monkeypatch.setattr(engine_module, "sample", sample)


def serve(llm, *requests: tuple[str, dict]) -> tuple[list[httpx.Response], bool]:
    """Send the requests at once to a fresh app around `llm`'s engine; the responses,
    and whether the engine is still alive afterwards."""

    async def main():
        engine = AsyncEngine(llm.engine)
        app = create_app(engine, llm.tokenizer, "tiny", WorkerState(phase="ready"))
        engine.start(asyncio.get_running_loop())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker") as c:
                responses = await asyncio.gather(*(c.post(path, json=body) for path, body in requests))
                health = await c.get("/health")
                return list(responses), engine.alive and health.status_code == 200
        finally:
            engine.stop()

    return asyncio.run(main())


def test_a_failed_request_gets_a_server_error_naming_the_stage_and_the_other_is_served(llm, doomed_sampling):
    [alone], _ = serve(llm, ("/v1/completions", GOOD))
    (failed, served), alive = serve(llm, ("/v1/completions", DOOMED), ("/v1/completions", GOOD))
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["type"] == "server_error" and error["message"].startswith("sampling failed for this request: ")
    assert served.status_code == 200 and served.json()["choices"] == alone.json()["choices"]
    assert alive


def test_a_failed_stream_ends_with_an_error_event(llm, doomed_sampling):
    (failed, chat), alive = serve(llm, ("/v1/completions", DOOMED | {"stream": True}),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
    assert failed.status_code == 200  # the headers went out before the sequence failed
    events = sse_data(failed.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"].startswith("sampling failed for this request: ")
    assert chat.status_code == 200 and alive


def test_the_offline_api_raises_naming_the_prompt_and_stage(llm, doomed_sampling):
    with pytest.raises(RuntimeError, match="^prompt 0: sampling failed for this request: "):
        llm.generate([[5, 6]], max_tokens=3, temperature=1.0, seed=DOOMED_SEED)
    assert llm.generate([[5, 6]], max_tokens=3)[0].token_ids  # and it goes on
