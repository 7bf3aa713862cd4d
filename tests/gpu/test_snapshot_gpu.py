"""Snapshots on a GPU host (issue 37, preloadd/snapshot.py): the zygote, its imports and the
workers' Triton kernels imported, is checkpointed with CRIU and restored by a start on the
GPU, whose workers (forked from it, CUDA only after the fork) serve the same greedy output as
those of a plain start. Needs a CRIU whose `criu check` passes ($PRELOAD_CRIU or PATH; on the
device machine a binary carried with its libraries); skipped, with CRIU's reason, elsewhere."""

import json
import os
import shutil
import subprocess

import pytest
from daemons import free_port, preload, running_daemon
from supervised import complete, start_args

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def criu() -> str:
    path = os.environ.get("PRELOAD_CRIU") or shutil.which("criu")
    if not path:
        pytest.skip("no criu: set $PRELOAD_CRIU or put CRIU 4.x on PATH")
    r = subprocess.run([path, "check"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"`{path} check` fails here: {(r.stdout + r.stderr).strip()[-300:]}")
    return path


def text(port: int) -> str:
    return complete(port, max_tokens=16)["choices"][0]["text"]


def test_a_restored_zygote_forks_gpu_workers_that_serve_as_a_launched_ones_do(criu, model_dir, tmp_path):
    port = free_port()
    with running_daemon(tmp_path / "plain", model_dir, *start_args(port, 1, "--spare-workers", 0), "--device", "cuda:0"):
        want = text(port)
    taken = preload("snapshot", tmp_path / "snap", timeout=300)
    assert taken.returncode == 0, taken.stdout + taken.stderr
    meta = json.loads((tmp_path / "snap" / "snapshot.json").read_text())
    assert meta["kernels_imported"] is True  # (a GPU host's zygote imports them while idle: done before the dump)
    port = free_port()
    args = (*start_args(port, 1, "--spare-workers", 0), "--device", "cuda:0", "--restore", tmp_path / "snap")
    with running_daemon(tmp_path / "restored", model_dir, *args) as d:
        restore = d.status()["restore"]
        assert restore["restored"] is True, restore
        assert text(port) == want
