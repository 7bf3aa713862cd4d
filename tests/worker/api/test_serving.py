"""A request's latency metrics time each engine step's tokens when they reached the server:
a reader that lags behind the engine gets several steps merged into one Output, and still
the time to the first token is observed once and the time between tokens once per step
after it, as vLLM's inter-token latency is (not once per merged read)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from daemons import metrics, total
from prometheus_client import generate_latest

from preload.worker.api.metrics import WorkerMetrics
from preload.worker.api.serving import Serving
from preload.worker.engine.output import Output
from preload.worker.engine.sampling_params import SamplingParams
from preload.worker.engine.sequence import Sequence


def timed(reads: list[Output], seq: Sequence, arrived: float) -> tuple[list[Output], dict[str, float]]:
    """What Serving._timed yields for a request whose engine Outputs are read as `reads`, and
    the worker's metrics after it."""
    worker_metrics = WorkerMetrics(SimpleNamespace(), "m")
    serving = Serving(SimpleNamespace(), SimpleNamespace(chat_template=None), ("m",), None, worker_metrics)

    async def outputs():
        for out in reads:
            yield out

    async def read():
        return [out async for out in serving._timed(outputs(), seq, arrived)]

    got = asyncio.run(read())
    return got, metrics(generate_latest(worker_metrics.registry).decode())


def test_steps_merged_for_a_lagging_reader_are_timed_one_by_one():
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=4))
    reads = [Output(seq.id, [7], landed=(10.0,)),  # the first step read alone, the next three merged into one read
             Output.merge([Output(seq.id, [8], landed=(10.5,)), Output(seq.id, [9], landed=(11.0,)),
                           Output(seq.id, [10], finish_reason="length", landed=(12.0,))])]
    got, m = timed(reads, seq, arrived=9.75)
    assert [out.token_ids for out in got] == [[7], [8, 9, 10]]
    assert total(m, "preload_time_to_first_token_seconds_count") == 1
    assert total(m, "preload_time_to_first_token_seconds_sum") == 0.25
    assert total(m, "preload_time_per_output_token_seconds_count") == 3
    assert total(m, "preload_time_per_output_token_seconds_sum") == 2.0  # 0.5 + 0.5 + 1.0
    assert total(m, "preload_e2e_request_latency_seconds_sum") == 2.25  # arrival to the last step's landing
    assert total(m, "preload_generation_tokens_total") == 4


def test_merged_outputs_keep_every_step_s_landing_in_order():
    steps = [Output(1, [5], landed=(1.0,)), Output(1, [], landed=()), Output(1, [6, 7], landed=(2.0,))]
    assert Output.merge(steps).landed == (1.0, 2.0)


def test_a_request_that_generates_nothing_is_still_counted_once_finished():
    """A prompt scored with no token generated (lm-eval's loglikelihood): its one Output,
    read as it comes, is its first and its last."""
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=1))
    _, m = timed([Output(seq.id, [], prompt_logprobs=[None, -1.0, -2.0], finish_reason="length")], seq, arrived=0.0)
    assert total(m, "preload_request_success_total", finished_reason="length") == 1
    assert sum(v for k, v in m.items() if k.startswith("preload_time_per_output_token_seconds_count")) == 0
