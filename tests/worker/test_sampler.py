"""Sampling: greedy, seeded reproducibility, top-p truncation, argument checks."""

import pytest
import torch

from preload.worker.engine.sampler import SamplingParams, sample, top_p_filter


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


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5)])
def test_rejects_out_of_range_arguments(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
