"""Sampling: greedy (temperature 0 or below GREEDY_BELOW), seeded reproducibility,
top-k, min-p and top-p truncation, and the ranges SamplingParams refuses, naming the parameter."""

import math

import pytest
import torch

from preload.worker.engine.sampler import apply_penalties, sample, sample_batch, steer, top_p_filter
from preload.worker.engine.sampling_params import GREEDY_BELOW, RequestError, SamplingParams


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([0.1, 0.5, 0.3, 0.1])
    assert top_p_filter(probs.clone(), 0.7).tolist() == pytest.approx([0.0, 0.5, 0.3, 0.0])
    assert top_p_filter(probs.clone(), 0.4).tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0])


def test_greedy_and_seeded_sampling():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample(logits, SamplingParams(), None) == 1
    p = SamplingParams(temperature=1.0, seed=7)
    draw = lambda: [sample(logits, p, torch.Generator().manual_seed(7)) for _ in range(5)]
    assert draw() == draw()
    many = {sample(logits, p, g) for g in [torch.Generator().manual_seed(i) for i in range(200)]}
    assert many >= {1, 3}


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, GREEDY_BELOW / 2])
def test_temperatures_below_epsilon_are_greedy(temperature):
    # Dividing by such a temperature gives inf logits and NaN probabilities.
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    p = SamplingParams(temperature=temperature)
    assert p.greedy and sample(logits, p, torch.Generator().manual_seed(0)) == 1


def test_the_smallest_sampled_temperature_still_samples_a_valid_token():
    # The extremes together: logits / 1e-5, a top_p below any probability, penalties.
    logits = torch.randn(2048)
    p = SamplingParams(temperature=GREEDY_BELOW, top_p=5e-324, top_k=3, presence_penalty=-2, seed=1)
    want = int(apply_penalties(logits, [5, 5, 7], -2, 0).argmax())
    assert sample(logits, p, torch.Generator().manual_seed(1), [5, 5, 7]) == want


@pytest.mark.parametrize("param, value", [
    ("max_tokens", 0), ("temperature", -1.0), ("temperature", 2.01), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_k", -1), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("logprobs", 21), ("logprobs", -1), ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan), ("presence_penalty", 2.5), ("frequency_penalty", -math.inf),
])
def test_rejects_out_of_range_arguments_naming_them(param, value):
    with pytest.raises(RequestError, match=f"^{param} ") as e:
        SamplingParams(**{param: value})
    assert e.value.param == param


# ---- the batch sampler the engine runs, held to the one-row reference ---------------------


def reference_probs(logits: torch.Tensor, p: SamplingParams, generated: list[int] = ()) -> torch.Tensor:
    """The distribution the one-row reference draws from."""
    x = apply_penalties(logits, list(generated), p.presence_penalty, p.frequency_penalty) / p.temperature
    first = x.softmax(-1)  # min-p, in vLLM's order: on the probabilities after temperature, before top-k
    x = x.masked_fill(first < p.min_p * first.max(), float("-inf"))
    if 0 < p.top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], float("-inf"))
    probs = x.softmax(-1)
    probs = top_p_filter(probs, p.top_p) if p.top_p < 1.0 else probs
    return probs / probs.sum()  # the multinomial draw renormalizes what top-p kept


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.2, min_p=0.15),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.8, min_p=0.05, presence_penalty=1.0, frequency_penalty=0.5),
], ids=["plain", "top-k", "top-p", "min-p", "all"])
def test_batch_draws_follow_the_reference_distribution(params):
    torch.manual_seed(0)
    logits = torch.randn(32) * 2
    generated = [3, 3, 7]
    rows = 20000  # the same row many times: its draws are independent
    tokens = sample_batch(logits.expand(rows, -1).clone(), [params] * rows, [None] * rows, [generated] * rows)
    seen = torch.bincount(tokens, minlength=32).float() / rows
    want = reference_probs(logits, params, generated)
    assert (seen[want == 0] == 0).all(), "a token outside top-k / top-p was drawn"
    assert (seen - want).abs().max() < 0.015, (seen, want)


def test_batch_rows_keep_their_own_params_seeds_and_penalties():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    greedy = SamplingParams()
    penalized = SamplingParams(presence_penalty=2.0)  # greedy, but the token it would pick is penalized away
    seeded = SamplingParams(temperature=1.0, seed=11)
    params = [greedy, penalized, seeded, greedy, seeded, SamplingParams(temperature=1e-6)]
    first = int(logits[1].argmax())
    generated = [[], [first], [], [], [], []]

    def gens():
        return [torch.Generator().manual_seed(11) if p is seeded else None for p in params]

    a = sample_batch(logits.clone(), params, gens(), generated)
    b = sample_batch(logits.clone(), params, gens(), generated)
    assert a[0] == logits[0].argmax() and a[3] == logits[3].argmax() and a[5] == logits[5].argmax()
    assert a[1] == apply_penalties(logits[1], [first], 2.0, 0.0).argmax() != first
    assert a[2] == b[2] and a[4] == b[4], "a seeded row draws the same again"
    alone = sample_batch(logits[2:3].clone(), [seeded], [torch.Generator().manual_seed(11)], [[]])
    assert a[2] == alone[0], "a seeded row's draw does not depend on the rows beside it"


def test_steer_adds_logit_bias_and_leaves_rows_that_ask_nothing():
    logits = torch.zeros(2, 6)
    biased = SamplingParams(logit_bias=((2, 5.0), (4, -100.0)))
    out = steer(logits, [SamplingParams(), biased], [[1], [1]], [[], []], frozenset({0}))
    assert out[0].tolist() == [0.0] * 6 and logits.abs().sum() == 0  # a copy; the plain row as it was
    assert out[1].tolist() == [0.0, 0.0, 5.0, 0.0, -100.0, 0.0]


def test_steer_repetition_penalty_as_vllm_applies_it():
    # Seen tokens (prompt or output): a positive logit divided, a negative one multiplied.
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    out = steer(logits, [SamplingParams(repetition_penalty=2.0)], [[0, 1]], [[1, 4]], frozenset())
    assert out[0].tolist() == [1.0, -4.0, 2.0, -2.0, 0.5]


def test_steer_bans_the_stop_tokens_until_min_tokens():
    p = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(3,))
    logits = torch.zeros(1, 5)
    early = steer(logits, [p], [[1]], [[4]], frozenset({0}))[0]
    assert early[0] == float("-inf") and early[3] == float("-inf") and early[1:3].tolist() == [0.0, 0.0]
    assert steer(logits, [p], [[1]], [[4, 4]], frozenset({0}))[0].tolist() == [0.0] * 5  # two out: allowed


def test_a_placeholder_counts_as_the_token_pending_on_the_device():
    """A step launched ahead draws before the last token reaches the host (pipeline.py):
    its placeholder (-1) ends the output and its value is pending on the device; the
    penalties, repetition's and min_tokens' count take it as if it were there."""
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0], [0.5, 1.0, 2.0, 2.1, 0.0]])
    params = [SamplingParams(repetition_penalty=2.0, min_tokens=3, stop_token_ids=(4,)),
              SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)]
    known, placeheld, pending = [[1, 2], [3, 3]], [[1, -1], [3, -1]], torch.tensor([2, 3])
    want = steer(logits, params, [[0], [0]], known, frozenset())
    got = steer(logits, params, [[0], [0]], placeheld, frozenset(), pending=pending)
    assert torch.equal(got, want) and got[0, 4] == float("-inf")  # (two out of three: a stop still barred)
    rows, penalized = torch.tensor([[0.5, 1.0, 1.5, 3.2, 0.0]]).expand(2, -1), params[1:] * 2
    assert sample_batch(rows.clone(), penalized, [None] * 2, [[3, 3], [3]]).tolist() == [2, 3]  # (3 seen twice, once)
    assert sample_batch(rows.clone(), penalized, [None] * 2, [[3, -1], [3]], pending=torch.tensor([3, 0])).tolist() == [2, 3]


@pytest.mark.parametrize("bad", [dict(repetition_penalty=0.0), dict(repetition_penalty=2.5),
                                 dict(logit_bias=((1, 101.0),)), dict(max_tokens=2, min_tokens=3), dict(min_tokens=-1)])
def test_steering_ranges_are_refused_naming_the_parameter(bad):
    with pytest.raises(RequestError) as e:
        SamplingParams(**bad)
    assert e.value.param in bad
