"""A checkpoint's headers read without torch say where every tensor's bytes are, exactly
as safetensors reads them; a header that lies is refused, naming the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from preload.checkpoint.headers import CheckpointError, read_headers


def test_the_headers_give_each_tensors_bytes(tiny_checkpoint):
    headers = read_headers(tiny_checkpoint)
    (path,) = tiny_checkpoint.glob("*.safetensors")
    tensors = load_file(path)
    assert set(headers) == set(tensors)
    data = path.read_bytes()
    for name, t in tensors.items():
        h = headers[name]
        assert (h.path, h.dtype, h.shape) == (path, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        assert data[h.start : h.end] == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_header_that_lies_is_refused_naming_the_tensor(tiny_checkpoint, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    (path,) = model.glob("*.safetensors")
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["shape"] and v["shape"][0] % 10 != 9)
    header[name]["shape"][0] += 1  # more bytes than its offsets hold (the header keeps its length)
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    path.write_bytes(raw[:8] + text + raw[8 + n :])
    with pytest.raises(CheckpointError, match=f"tensor {name}: data_offsets"):
        read_headers(model)
