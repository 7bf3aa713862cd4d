"""Identity that cannot be fooled: a client naming a checkpoint is served the daemon's
weights only if that checkpoint holds exactly the same bytes. A copy is accepted, a
single changed value is refused naming the tensor, the daemon's very files are
accepted without being read again, and another quant, dtype or config is refused
saying what differs."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from daemons import running_daemon

import preload.checkpoint.reader as reader
from preload import LLM
from preload.checkpoint.identity import IdentityError, verify_checkpoint
from preload.preloadd.loader import load
from preload.preloadd.weights import Progress

CHANGED = "model.layers.1.mlp.experts.5.down_proj.weight"


@pytest.fixture(scope="module")
def daemon(tiny_checkpoint, tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("identity") / "state", tiny_checkpoint, "--dtype", "float32") as d:
        yield d


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def header_and_data(path: Path) -> tuple[bytes, dict, int]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[: 8 + n], json.loads(raw[8 : 8 + n]), 8 + n


def change_one_value(model: Path, tensor: str, index: int = 7) -> None:
    """Flip the lowest mantissa bit of one float32 element of `tensor`, in place:
    names, shapes, dtypes and the whole safetensors header stay byte-identical."""
    path = model / "model.safetensors"
    _, header, data_start = header_and_data(path)
    assert header[tensor]["dtype"] == "F32"
    at = data_start + header[tensor]["data_offsets"][0] + 4 * index
    with open(path, "r+b") as f:
        f.seek(at)
        (bits,) = struct.unpack("<I", f.read(4))
        f.seek(at)
        f.write(struct.pack("<I", bits ^ 1))


def calls_to_iter_checkpoint(monkeypatch) -> list:
    calls = []
    real = reader.iter_checkpoint

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(reader, "iter_checkpoint", counting)
    return calls


def inodes(model: Path) -> set[int]:
    return {p.stat().st_ino for p in model.iterdir()}


def test_a_copy_of_the_checkpoint_is_reread_and_accepted(daemon, tiny_checkpoint, tmp_path, monkeypatch):
    copy = copy_checkpoint(tiny_checkpoint, tmp_path / "copy")
    assert not inodes(copy) & inodes(tiny_checkpoint)
    calls = calls_to_iter_checkpoint(monkeypatch)
    llm = LLM(copy, state_dir=daemon.state_dir)
    try:
        assert llm.attached.fingerprint == daemon.status()["fingerprint"]
    finally:
        llm.close()
    assert calls, "a copy (other inodes) must be re-hashed, not trusted by name"


def test_the_daemons_own_files_are_accepted_without_rereading_them(daemon, tiny_checkpoint, monkeypatch):
    def must_not_read(*args, **kwargs):
        raise AssertionError("the checkpoint was read again although its files are the daemon's own")

    monkeypatch.setattr(reader, "iter_checkpoint", must_not_read)
    llm = LLM(tiny_checkpoint, state_dir=daemon.state_dir)
    try:
        assert llm.attached.fingerprint == daemon.status()["fingerprint"]
    finally:
        llm.close()


def test_one_changed_value_is_refused_naming_the_tensor(daemon, tiny_checkpoint, tmp_path):
    other = copy_checkpoint(tiny_checkpoint, tmp_path / "other")
    change_one_value(other, CHANGED)
    # same names, shapes and headers: only the value differs
    assert header_and_data(other / "model.safetensors")[0] == header_and_data(tiny_checkpoint / "model.safetensors")[0]
    with pytest.raises(IdentityError) as refused:
        LLM(other, state_dir=daemon.state_dir)
    assert CHANGED in str(refused.value)
    assert str(other / "model.safetensors") in str(refused.value)
    assert os.getpid() not in daemon.status()["attached_workers"], "a refused client must not stay attached"


@pytest.mark.parametrize("file", ["config.json", "tokenizer.json"])
def test_a_changed_config_or_tokenizer_is_refused_naming_the_file(file, daemon, tiny_checkpoint, tmp_path):
    other = copy_checkpoint(tiny_checkpoint, tmp_path / "other")
    data = json.loads((other / file).read_text())
    if file == "config.json":
        data["rms_norm_eps"] = 1e-5
    else:
        data["model"]["vocab"]["t5"], data["model"]["vocab"]["t6"] = 6, 5
    (other / file).write_text(json.dumps(data))
    with pytest.raises(IdentityError, match=file.replace(".", r"\.")):
        LLM(other, state_dir=daemon.state_dir)
    assert os.getpid() not in daemon.status()["attached_workers"]


@pytest.mark.parametrize(
    "asked, held",
    [({"quant": "fp8_block"}, "none"), ({"quant": "fp8_per_tensor"}, "none"), ({"dtype": "bfloat16"}, "float32")],
    ids=["quant-fp8_block", "quant-fp8_per_tensor", "dtype-bfloat16"],
)
def test_another_quant_or_dtype_is_refused_saying_what_differs(asked, held, daemon, tiny_checkpoint):
    (key, value), = asked.items()
    with pytest.raises(IdentityError) as refused:
        LLM(tiny_checkpoint, state_dir=daemon.state_dir, **asked)
    message = str(refused.value)
    assert key in message and value in message and held in message
    assert os.getpid() not in daemon.status()["attached_workers"]


def fingerprint_of(model: Path, quant: str = "none") -> tuple[str, dict]:
    """What the daemon would serve for `model`: loaded in-process with the daemon's loader."""
    loaded = load(model, quant, torch.float32, torch.device("cpu"), "memfd", Progress())
    loaded.arena.close()
    return loaded.manifest.fingerprint, loaded.manifest.record


def test_the_fingerprint_is_the_bytes_the_config_and_the_settings(daemon, tiny_checkpoint, tmp_path):
    held, _ = fingerprint_of(tiny_checkpoint)
    assert held == daemon.status()["fingerprint"]
    copy = copy_checkpoint(tiny_checkpoint, tmp_path / "copy")
    assert fingerprint_of(copy)[0] == held
    other = copy_checkpoint(tiny_checkpoint, tmp_path / "other")
    change_one_value(other, CHANGED)
    assert fingerprint_of(other)[0] != held
    assert fingerprint_of(tiny_checkpoint, "fp8_per_tensor")[0] != held
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"rms_norm_eps": 1e-5}))
    assert fingerprint_of(copy)[0] != held


def test_files_rewritten_in_place_are_rehashed(tiny_checkpoint, tmp_path):
    """The shortcut trusts a file only while its identity (device, inode, size, mtime)
    is unchanged: touching it forces a re-hash (same bytes: accepted); changing a
    value in place is then caught."""
    model = copy_checkpoint(tiny_checkpoint, tmp_path / "model")
    _, record = fingerprint_of(model)
    verify_checkpoint(model, record)
    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    verify_checkpoint(model, record)
    change_one_value(model, CHANGED)
    with pytest.raises(IdentityError, match=CHANGED.replace(".", r"\.")):
        verify_checkpoint(model, record)


def test_a_record_of_another_format_is_refused_not_compared():
    from preload.checkpoint.identity import FORMAT, Record

    wire = Record({"config.json": "ab"}, {}).to_wire()
    assert wire["format"] == FORMAT and Record.from_wire(wire).aux == {"config.json": "ab"}
    with pytest.raises(ValueError, match="format 1"):
        Record.from_wire({k: v for k, v in wire.items() if k != "format"})  # SHA-256 days: no format field
