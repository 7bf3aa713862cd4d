"""A checkpoint's safetensors headers, read without torch: which files, which tensors,
their dtypes, shapes and byte ranges, checked before any byte of a tensor is trusted.

The daemon plans a load (and loads one that needs no arithmetic, preloadd/copy_loader.py)
from these alone, while torch, seconds to import, is not needed yet or not at all.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# safetensors' dtype codes as torch names them (what manifests and digests carry)
TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
               "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
               "BOOL": "bool"}


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or disagrees with config.json."""


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    return files


def _read_header(path: Path) -> tuple[dict, int, int]:
    """(header without its metadata, where the data starts, how many data bytes follow)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data_bytes = f.seek(0, 2) - 8 - n
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n, data_bytes


def header_problem(path: Path) -> str | None:
    """What is wrong with a safetensors file, naming the first tensor whose header entry
    lies (its bytes do not match its shape, or it runs past the end of the file, or
    overlaps its neighbour); None if nothing is."""
    try:
        header, _, data_bytes = _read_header(path)
        ranges = {name: (info["dtype"], info["shape"], *info["data_offsets"]) for name, info in header.items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable safetensors header ({e})"
    # An entry that lies on its own first (its size, or the file's end), since moving one
    # entry also leaves a gap beside an honest neighbour.
    for name, (dtype, shape, a, b) in ranges.items():
        if b - a != math.prod(shape) * DTYPE_BYTES.get(dtype, 0):
            return f"tensor {name}: data_offsets [{a}, {b}] do not hold a {dtype} tensor of shape {shape}"
        if b > data_bytes:
            return f"tensor {name}: data_offsets [{a}, {b}] run past the end of the data ({data_bytes} bytes; truncated file?)"
    end = 0
    for name, (_, _, a, b) in sorted(ranges.items(), key=lambda kv: kv[1][2]):
        if a != end:
            return f"tensor {name}: data_offsets [{a}, {b}] leave a gap or overlap after byte {end}"
        end = b
    return None


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes are: file, torch dtype name, shape, [start, end) in the file."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_headers(model_dir: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of a checkpoint by name, from the headers alone, each file checked."""
    tensors: dict[str, StoredTensor] = {}
    for path in safetensors_files(model_dir):
        problem = header_problem(path) if path.exists() else "missing"
        if problem:
            raise CheckpointError(f"{path}: {problem}")
        header, data_start, _ = _read_header(path)
        for name, info in header.items():
            a, b = info["data_offsets"]
            tensors[name] = StoredTensor(path, TORCH_NAMES[info["dtype"]], tuple(info["shape"]), data_start + a, data_start + b)
    return tensors
