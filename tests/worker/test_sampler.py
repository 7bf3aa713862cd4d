"""Sampling: greedy (temperature 0 or below GREEDY_BELOW), seeded reproducibility,
top-p truncation, and the ranges SamplingParams refuses, naming the parameter."""

import math

import pytest
import torch

from preload.worker.engine.sampler import apply_penalties, sample, top_p_filter
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
    ("logprobs", 21), ("logprobs", -1), ("presence_penalty", 2.5), ("frequency_penalty", -math.inf),
])
def test_rejects_out_of_range_arguments_naming_them(param, value):
    with pytest.raises(RequestError, match=f"^{param} ") as e:
        SamplingParams(**{param: value})
    assert e.value.param == param
