"""`preload kernels` says where the workers' kernel cache is and what its list holds;
`preload kernels compile LIST` fills the cache from a list recorded on another host,
without a GPU (as an image build runs it), adds the kernels to the cache's own list, and
exits 3 naming each kernel it could not compile (1 on an error: no list, a damaged one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from kernel_specs import CASES, rms_norm_spec  # noqa: E402

from preload.kernels import ahead  # noqa: E402


@pytest.fixture
def env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (compiled for real)
    return env | {"TRITON_CACHE_DIR": str(tmp_path / "cache")}


def preload(env, *args, code: int = 0) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "preload.cli.main", *args], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == code, r.stdout + r.stderr[-3000:]
    return r


def a_list(path, specs) -> str:
    path.write_text(json.dumps({"kernels": {ahead.entry_digest(s): s for s in specs}}))
    return str(path)


def test_a_list_from_another_host_fills_this_cache_and_its_list(tmp_path, env):
    listed = a_list(tmp_path / "from-a-gpu-host.json", [rms_norm_spec(add, block)[0] for add, block in CASES])
    r = preload(env, "kernels", "compile", listed, "--processes", "2")
    assert "compiled 3 of 3 kernels into" in r.stdout and "(2 processes)" in r.stdout
    cache = tmp_path / "cache"
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 3  # (the compiled kernels, one dir each)
    assert ahead.read_list(ahead.list_path(cache)) == ahead.read_list(listed)
    shown = preload(env, "kernels").stdout
    assert f"kernel cache: {cache}" in shown and "3 kernels recorded" in shown and "3  _rms_norm" in shown
    # Compiled again from the cache's own list: found there, nothing new.
    assert "compiled 3 of 3" in preload(env, "kernels", "compile").stdout
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 3


def test_kernels_that_do_not_compile_are_named_and_the_rest_compiled(tmp_path, env):
    good = rms_norm_spec(True, 512)[0]
    gone = json.dumps(json.loads(good) | {"name": "preload.kernels.fused_norm._renamed_since"})
    r = preload(env, "kernels", "compile", a_list(tmp_path / "l.json", [gone, good]), code=3)  # (an error: 1)
    assert "compiled 1 of 2" in r.stdout and "not compiled: preload.kernels.fused_norm._renamed_since" in r.stderr
    assert list(ahead.read_list(ahead.list_path(tmp_path / "cache")).values()) == [good]


def test_no_list_or_a_damaged_one_is_said(tmp_path, env):
    assert "no kernels listed in" in preload(env, "kernels", "compile", code=1).stderr
    (tmp_path / "bad.json").write_text('{"kernels": [1, 2]}')
    assert "is not a kernel list" in preload(env, "kernels", "compile", str(tmp_path / "bad.json"), code=1).stderr
    assert "none yet" in preload(env, "kernels").stdout
