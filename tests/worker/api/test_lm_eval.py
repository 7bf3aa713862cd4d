"""EleutherAI's lm-eval harness scoring a real worker through the completions API
(`local-completions`), offline: two local tasks written here, each a JSONL file read by
the `json` dataset builder.

What is specified: a multiple-choice task (loglikelihood: lm-eval sends each context +
choice as token ids with `echo: true, logprobs: 1` and reads the choice's log-prob back)
gets the accuracy that the server's own scores of those tokens give; a generate_until
task (lm-eval sends the prompt's token ids with `stop` and `max_tokens`) gets exact_match
1 where the target is the server's greedy answer and 0 where it is not; the worker's
/metrics counted every request lm-eval made, each answered 200.

lm-eval splits context and continuation with a tokenizer of its own: the served
checkpoint's tokenizer.json through transformers (`tokenizer_backend=huggingface`), which
encodes as the server's /tokenize does without special tokens.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import httpx
import pytest
from daemons import total
from workers import bundled_model_ready, one_worker

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.skipif(not bundled_model_ready(), reason="needs the bundled model (it writes Python)")

# Contexts whose right choice the bundled model (trained on Python) prefers by nats; the
# last is labelled with the wrong choice, so the accuracy is not 1 whatever lm-eval read.
MULTIPLE_CHOICE = [
    {"question": "import", "choices": ["os", ")))"], "answer": 0},
    {"question": "def add(a, b):\n    return a +", "choices": ["class", "b"], "answer": 1},
    {"question": "if __name__ ==", "choices": ["'__main__':", "import for"], "answer": 0},
    {"question": "class Foo(", "choices": ["object):", "def def"], "answer": 0},
    {"question": "    def __init__(self", "choices": ["]]]", "):"], "answer": 0},  # (mislabelled)
]
PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Point:\n    def __init__(self"]
UNTIL = ["\n\n"]
MAX_GEN = 6

RUN = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

model_args, include = sys.argv[1:3]
out = simple_evaluate(model="local-completions", model_args=model_args, tasks=["preload_mc", "preload_gen"],
                      task_manager=TaskManager(include_path=include), log_samples=False)
print("RESULTS " + json.dumps(out["results"], default=str))
"""


@pytest.fixture(scope="module")
def worker(model, tmp_path_factory):
    with one_worker(model, tmp_path_factory, "lm-eval") as w:
        yield w


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def encode(worker, text: str) -> list[int]:
    """What lm-eval's huggingface tokenizer makes of `text` (no special tokens)."""
    return ok(worker.post("/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"]


def loglikelihood(worker, context: str, continuation: str) -> float:
    """The continuation's log-prob after the context, as the server scores it, for the
    tokens lm-eval sends (its split: whole and context encoded, the rest the continuation)."""
    ctx = encode(worker, context)
    whole = encode(worker, context + continuation)
    assert whole[: len(ctx)] == ctx
    body = ok(worker.post("/v1/completions", {"prompt": whole, "echo": True, "logprobs": 1, "max_tokens": 0}))
    return sum(body["choices"][0]["logprobs"]["token_logprobs"][len(ctx):])


def greedy(worker, prompt: str) -> str:
    body = {"prompt": encode(worker, prompt), "max_tokens": MAX_GEN, "temperature": 0, "stop": UNTIL + ["<|end|>"]}
    return ok(worker.post("/v1/completions", body))["choices"][0]["text"]


def write_tasks(path, worker) -> tuple[list[str], list[str]]:
    """The two tasks under `path`; the generation targets (right, right, wrong)."""
    (path / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MULTIPLE_CHOICE))
    targets = [greedy(worker, p) for p in PROMPTS[:2]] + ["not what it says"]
    (path / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n"
                                            for p, t in zip(PROMPTS, targets)))
    common = "dataset_path: json\ntest_split: test\n"
    (path / "mc.yaml").write_text(
        "task: preload_mc\n" + common
        + f"dataset_kwargs:\n  data_files:\n    test: {path / 'mc.jsonl'}\n"
        + "output_type: multiple_choice\n"
        + 'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        + "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (path / "gen.yaml").write_text(
        "task: preload_gen\n" + common
        + f"dataset_kwargs:\n  data_files:\n    test: {path / 'gen.jsonl'}\n"
        + "output_type: generate_until\n"
        + 'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        + f"generation_kwargs:\n  until: {json.dumps(UNTIL)}\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n"
        + "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return targets


def run_lm_eval(worker, model, name: str, include, cwd) -> dict:
    model_args = ",".join([f"base_url={worker.url}/v1/completions", f"model={name}", f"tokenizer={model}",
                           "tokenizer_backend=huggingface", "num_concurrent=1", "max_retries=1"])
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                        "HF_HOME": str(cwd / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", RUN, model_args, str(include)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    return json.loads(line.removeprefix("RESULTS "))


def test_lm_eval_scores_a_multiple_choice_and_a_generation_task(worker, model, tmp_path):
    name = ok(worker.get("/v1/models"))["data"][0]["id"]
    targets = write_tasks(tmp_path, worker)
    # What the server's own scores say of each multiple-choice item (lm-eval puts a space
    # between the question and a choice), each by a clear margin.
    expected_right = []
    for doc in MULTIPLE_CHOICE:
        scores = [loglikelihood(worker, doc["question"], " " + c) for c in doc["choices"]]
        assert abs(scores[0] - scores[1]) > 1.0, (doc, scores)
        expected_right.append(scores.index(max(scores)) == doc["answer"])
    assert expected_right == [True, True, True, True, False]  # the items are what they were made to be
    assert all(targets[:2])

    def completions(status: str) -> float:
        try:
            return total(worker.metrics(), "preload_http_requests_total", route="/v1/completions", status=status)
        except AssertionError:  # (no such series yet)
            return 0.0

    before_ok, before_bad = completions("200"), completions("400")
    results = run_lm_eval(worker, model, name, tmp_path, tmp_path)

    acc = results["preload_mc"]["acc,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    assert math.isclose(acc, sum(expected_right) / len(expected_right))
    exact = results["preload_gen"]["exact_match,none"]
    assert isinstance(exact, float) and 0.0 <= exact <= 1.0
    assert math.isclose(exact, 2 / 3)  # the server's greedy answers, and not the wrong target

    # One request per choice and one per prompt (lm-eval's batch size 1), every one answered.
    asked = sum(len(d["choices"]) for d in MULTIPLE_CHOICE) + len(PROMPTS)
    assert completions("200") - before_ok == asked
    assert completions("400") == before_bad
