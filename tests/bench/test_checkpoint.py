"""`preload make-checkpoint`'s shapes are models the engine takes; v3-draft can draft for
v3-slice (same vocabulary) and is small beside it."""

from __future__ import annotations

import math

import pytest

from preload.bench.checkpoint import SHAPES
from preload.checkpoint.config import ModelConfig
from preload.checkpoint.shapes import checkpoint_shapes


def nbytes(config: dict) -> int:
    cfg = ModelConfig.from_dict(config)
    return sum(2 * math.prod(shape) for shape in checkpoint_shapes(cfg, with_mtp=False).values())


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_is_a_model_config(shape):
    cfg = ModelConfig.from_dict(SHAPES[shape](1))
    assert cfg.num_layers >= 2 and checkpoint_shapes(cfg, with_mtp=False)


def test_the_v3_draft_has_v3s_vocabulary_and_a_fortieth_of_its_weights():
    draft, target = SHAPES["v3-draft"](1), SHAPES["v3-slice"](1)
    assert draft["vocab_size"] == target["vocab_size"]
    assert nbytes(draft) < nbytes(target) / 40
