"""`--reasoning-parser deepseek_r1`, as vLLM serves it: a chat reply's thinking comes back
as `reasoning_content` beside `content`, whole and streamed (`delta.reasoning_content`):

- everything before </think> is reasoning (a <think> the reply opens with dropped), what
  follows is content; a reply that never closes its thinking is all reasoning (content
  null), as DeepSeek-R1's template opens the <think> itself;
- a stream's reasoning deltas, then its content deltas, join to the whole reply's two
  parts, however the text is cut into pieces (a </think> arriving across pieces never
  shows up in either);
- without the parser there is no `reasoning_content`: the reply is content, as it was
  written.

The tiny model writes Python and never </think>: a logits processor defined here (loaded
by the workers with --logits-processors) writes a scripted reply, token by token, to a
prompt that holds a trigger; the model goes on by itself after the script.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from preload.worker.api import reasoning

HERE = Path(__file__).resolve().parent
PLAIN = [{"role": "user", "content": "Hello"}]
# Prompts that hold a trigger get a scripted reply: (user message, the reply's first text).
SCRIPTS = {
    "opened": ("Script one, please.", "<think>Paris is big.</think>It is"),  # the reply opens its <think>
    "template": ("Script two, please.", "Rome, then.</think>Rome"),  # the template opened it
    "unclosed": ("Script three, please.", "<think>Still thinking"),
}
EXTRA = 6  # tokens the model writes itself after the script


class Script:
    """A logits processor (the workers below import it from this file): a reply to a prompt
    that holds one of `scripts`' triggers is that script's tokens, one by one."""

    def __init__(self, context, scripts: list[list[list[int]]]):
        self.scripts = scripts

    def __call__(self, logits: torch.Tensor, batch) -> torch.Tensor:
        for row, (prompt, out) in enumerate(zip(batch.prompts, batch.outputs)):
            for trigger, script in self.scripts:
                if len(out) < len(script) and holds(prompt, trigger):
                    logits[row] = float("-inf")
                    logits[row, script[len(out)]] = 0.0
        return logits


def holds(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


@pytest.fixture(scope="module")
def tokenize(model):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def workers(model, tmp_path_factory, tokenize):
    """Two workers on one daemon, both with the Script processor: `r1` with
    --reasoning-parser deepseek_r1, `plain` without."""
    from daemons import running_daemon
    from workers import running_workers

    scripts = [[tokenize(trigger), tokenize(text)] for trigger, text in SCRIPTS.values()]
    processor = ("--logits-processors", f"{Path(__file__).stem}:Script={json.dumps({'scripts': scripts})}")
    with running_daemon(tmp_path_factory.mktemp("reasoning") / "state", model, "--dtype", "float32") as d, \
            pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
        with running_workers(d.state_dir, tmp_path_factory.mktemp("logs"), (*processor, "--reasoning-parser",
                                                                            "deepseek_r1"), processor) as ws:
            yield dict(zip(("r1", "plain"), ws))


@pytest.fixture(scope="module")
def name(workers) -> str:
    return workers["r1"].get("/v1/models").json()["data"][0]["id"]


def sdk(worker) -> OpenAI:
    return OpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0, timeout=120)


def body(worker, name, messages, max_tokens, **kw) -> dict:
    """A greedy chat reply's JSON, as sent (to see which keys are there)."""
    r = worker.post("/v1/chat/completions", {"model": name, "messages": messages, "temperature": 0,
                                             "max_tokens": max_tokens, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def scripted(key: str) -> tuple[list[dict], str]:
    trigger, text = SCRIPTS[key]
    return [{"role": "user", "content": trigger}], text


def streamed(client, name, messages, max_tokens) -> tuple[str, str, list[str]]:
    """(reasoning, content, the order the deltas came in: "r" and "c") of a greedy stream."""
    stream = client.chat.completions.create(model=name, messages=messages, temperature=0, max_tokens=max_tokens,
                                            stream=True, extra_body={"ignore_eos": True})
    thought, content, order = "", "", []
    for chunk in stream:
        for c in chunk.choices:
            r = getattr(c.delta, "reasoning_content", None)
            if r:
                thought += r
                order.append("r")
            if c.delta.content:
                content += c.delta.content
                order.append("c")
    return thought, content, order


# --- the parser, against the real worker ---------------------------------------------


@pytest.mark.parametrize("key", ["opened", "template"])
def test_thinking_before_think_end_is_reasoning_content_and_the_rest_content(workers, name, tokenize, key):
    messages, script = scripted(key)
    n = len(tokenize(script)) + EXTRA
    raw = body(workers["plain"], name, messages, n)["choices"][0]["message"]["content"]
    assert raw.startswith(script)  # the script, then the model's own words
    message = body(workers["r1"], name, messages, n)["choices"][0]["message"]
    head, _, tail = script.partition("</think>")
    assert message["reasoning_content"] == head.removeprefix("<think>")
    assert message["content"] == raw.partition("</think>")[2]
    assert message["content"].startswith(tail) and len(message["content"]) > len(tail)
    assert (message["reasoning_content"], message["content"]) == reasoning.split(raw)


@pytest.mark.parametrize("key", ["opened", "template", "unclosed"])
def test_a_stream_gives_the_same_reasoning_then_content(workers, name, tokenize, key):
    messages, script = scripted(key)
    n = len(tokenize(script)) + EXTRA
    message = body(workers["r1"], name, messages, n)["choices"][0]["message"]
    thought, content, order = streamed(sdk(workers["r1"]), name, messages, n)
    assert thought == (message["reasoning_content"] or "")
    assert content == (message["content"] or "")
    assert "</think>" not in thought + content and "<think>" not in thought
    assert order == sorted(order, key="rc".index)  # reasoning first, then content
    assert len(order) > 2  # streamed in pieces, not at the end


def test_a_reply_that_never_closes_its_thinking_is_all_reasoning(workers, name, tokenize):
    messages, script = scripted("unclosed")
    n = len(tokenize(script)) + EXTRA
    raw = body(workers["plain"], name, messages, n)["choices"][0]["message"]["content"]
    message = body(workers["r1"], name, messages, n)["choices"][0]["message"]
    assert message["reasoning_content"] == raw.removeprefix("<think>")
    assert message["content"] is None  # null, as vLLM's parser returns it


def test_the_models_own_reply_is_all_reasoning(workers, name):
    """Unscripted, the tiny model never writes </think>: all of its reply is reasoning."""
    raw = body(workers["plain"], name, PLAIN, 12)["choices"][0]["message"]["content"]
    assert raw and not raw.startswith("\n")  # (so that no newline stripping could make the two differ)
    out = body(workers["r1"], name, PLAIN, 12)
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] == raw
    assert message["content"] is None
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 12
    thought, content, _ = streamed(sdk(workers["r1"]), name, PLAIN, 12)
    assert thought == raw and content == ""


def test_without_the_parser_there_is_no_reasoning_content(workers, name, tokenize):
    messages, script = scripted("opened")
    n = len(tokenize(script)) + EXTRA
    message = body(workers["plain"], name, messages, n)["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert message["content"].startswith(script)  # <think>...</think> left in, as written
    r = httpx.post(workers["plain"].url + "/v1/chat/completions", timeout=60,
                   json={"model": name, "messages": messages, "temperature": 0, "max_tokens": n, "stream": True,
                         "ignore_eos": True})
    chunks = [json.loads(d) for d in r.text.split("data: ")[1:] if not d.startswith("[DONE]")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]



# --- reasoning.split and ReasoningStream, piece by piece -----------------------------

TEXTS = [
    "<think>Paris is big.</think>It is",
    "Rome, then.</think>Rome",
    "<think>\nwhy\n</think>\n\nbecause",
    "a < b and c </ d, </thin></think>x</think>y",  # what only looks like the marker, and a second one
    "thinking",
    "<think>never closed <",
    "</think>only content",
    "only reasoning</think>",
    "<thi",
    "",
]


def stream_of(pieces: list[str]) -> tuple[str, str, list[str]]:
    s = reasoning.ReasoningStream()
    thought, content, order = "", "", []
    for i, piece in enumerate(pieces):
        r, c = s.delta(piece, i == len(pieces) - 1)
        thought, content = thought + r, content + c
        order += ["r"] * bool(r) + ["c"] * bool(c)
    return thought, content, order


def cuts(text: str):
    """`text` cut into pieces every way with up to two cuts, and into single characters."""
    n = len(text)
    yield [text]
    for i in range(n + 1):
        yield [text[:i], text[i:]]
        for j in range(i, n + 1):
            yield [text[:i], text[i:j], text[j:]]
    yield list(text) or [""]


@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_cut_anywhere_joins_to_the_split_of_the_whole(text):
    want = tuple(part or "" for part in reasoning.split(text))
    for pieces in cuts(text):
        thought, content, order = stream_of(pieces)
        assert (thought, content) == want, pieces
        assert order == sorted(order, key="rc".index), pieces


def test_split_as_deepseek_r1_is_read():
    assert reasoning.split("<think>Paris is big.</think>It is") == ("Paris is big.", "It is")
    assert reasoning.split("Rome, then.</think>Rome") == ("Rome, then.", "Rome")
    assert reasoning.split("still thinking") == ("still thinking", None)
    assert reasoning.split("done</think>") == ("done", None)
    assert reasoning.split("</think>answer") == (None, "answer")
    assert reasoning.split("a</think>b</think>c") == ("a", "b</think>c")


def test_a_think_end_arriving_in_pieces_is_held_back_until_it_is_whole():
    s = reasoning.ReasoningStream()
    assert s.delta("Paris is big.<", False) == ("Paris is big.", "")
    assert s.delta("/thi", False) == ("", "")  # maybe </think>: nothing yet
    assert s.delta("nk>It", False) == ("", "It")
    assert s.delta(" is", True) == ("", " is")
    s = reasoning.ReasoningStream()
    assert s.delta("a </th", False) == ("a ", "")
    assert s.delta("ere", False) == ("</there", "")  # not the marker after all: sent as reasoning
    s = reasoning.ReasoningStream()
    assert s.delta("<thi", False) == ("", "")  # maybe <think>
    assert s.delta("nk>why", False) == ("why", "")
    s = reasoning.ReasoningStream()
    assert s.delta("wait </thi", True) == ("wait </thi", "")  # the last piece holds nothing back
