"""Where a GPU daemon's workers keep the Triton kernels they compile: in a cache that
outlives the state dir (only a machine's first start compiles), held to the state dir's
checks (what is in it is code the workers run: tests/preloadd/test_state_dir_trust.py has
the walk's every case), the operator's TRITON_CACHE_DIR first."""

from __future__ import annotations

import logging
import os
import stat

from preload.preloadd.state_dir import kernel_cache_dir


def test_the_operators_triton_cache_dir_comes_first(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "theirs"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache_dir(tmp_path / "state") == tmp_path / "theirs"
    assert not (tmp_path / "xdg").exists()


def test_kernels_are_kept_in_the_users_cache_made_private(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = kernel_cache_dir(tmp_path / "state")
    assert path == tmp_path / "xdg" / "preload" / "kernels"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    (path / "kernel.cubin").write_bytes(b"compiled")  # found again by the next start, whatever its state dir
    assert kernel_cache_dir(tmp_path / "another-state") == path and (path / "kernel.cubin").exists()

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache_dir(tmp_path / "state") == tmp_path / "home" / ".cache" / "preload" / "kernels"


def test_a_cache_others_could_write_is_not_used(tmp_path, monkeypatch, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone could put a kernel of theirs where ours are looked for
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    with caplog.at_level(logging.WARNING):
        assert kernel_cache_dir(tmp_path / "state") == tmp_path / "state" / "triton"
    assert "writable by others" in caplog.text and "kernel cache" in caplog.text
    assert not (shared / "preload").exists()

