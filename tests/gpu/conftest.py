"""What the GPU tests share: a small DeepSeek V3 checkpoint stored as real ones are."""

import pytest
import torch
from checkpoints import CASES, make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    arch, overrides = CASES["v3-qlora-yarn"]
    # bf16 on disk, like real checkpoints; 128 wide so that fp8 blocks are whole.
    overrides = overrides | dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128)
    return save_hf_model(make_hf_model(arch, **overrides), tmp_path_factory.mktemp("gpu"), dtype=torch.bfloat16)
