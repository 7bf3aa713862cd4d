import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# The repository root is the package `preload` (installed so); its folders are not
# top-level modules. `python -m pytest` run from the root puts the root on sys.path, where
# `kernels/` would shadow the installed package of that name (transformers imports it).
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU): their
# indexing, masking and math are tested in CI too. Set before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under `make test`'s pytest-xdist workers, each one's torch gets its share of the CPUs: two
# workers of two threads each on two cores slowed the in-process engine tests many times
# over when both ran one (a speculative-decoding test 152 s; the suite 18:15, serially
# 14:31), as OpenMP threads do when they outnumber the cores.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random DeepSeek-V3 checkpoint (float32, q_lora, grouped routing, YaRN) for
    daemon tests, its dense MLP wider than one 128x128 FP8 block so that fp8_block and
    fp8_per_tensor differ. Shared by every test: copy it before changing anything in it."""
    from checkpoints import CASES, make_hf_model, save_hf_model

    arch, overrides = CASES["v3-qlora-yarn"]
    model = make_hf_model(arch, seed=11, **(overrides | {"intermediate_size": 288}))
    return save_hf_model(model, tmp_path_factory.mktemp("tiny-v3-ckpt"))


@pytest.fixture(scope="module")
def base_dir():
    """A private temp dir that another uid may traverse (pytest's own tmp root is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="preload-proto-", dir="/tmp"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)
