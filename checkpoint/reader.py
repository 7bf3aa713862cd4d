"""Reading an HF checkpoint directory: sharded or single safetensors, bf16/fp16/fp32
or DeepSeek's native FP8 (e4m3 weights with `weight_scale_inv` block scales)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from preload.checkpoint.config import ModelConfig, weights_dtype
from preload.checkpoint.headers import CheckpointError, header_problem, safetensors_files
from preload.checkpoint.pages import populate
from preload.checkpoint.shapes import wanted_shapes
from preload.kernels.fp8 import FP8
from preload.kernels.quant import SCALE_SUFFIX


class CheckpointReader:
    """Name -> file index over a checkpoint's safetensors files, read one tensor at a time (mmap)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = model_dir
        self._stack = ExitStack()
        self.files: dict[str, tuple[Path, object]] = {}
        for path in safetensors_files(model_dir):
            try:
                handle = self._stack.enter_context(safe_open(path, framework="pt"))
            except (SafetensorError, OSError) as e:
                self.close()
                raise CheckpointError(f"{path}: {header_problem(path) or f'cannot read safetensors header: {e}'}") from None
            for name in handle.keys():
                self.files[name] = (path, handle)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        """The tensor, a view of the file's mapping, its pages mapped in at once (populate)."""
        if name not in self.files:
            raise CheckpointError(f"{self.model_dir}: missing tensor {name}")
        path, handle = self.files[name]
        try:
            tensor = handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: tensor {name}: {e}") from None
        if tensor.nbytes:
            populate(tensor.data_ptr(), tensor.nbytes)  # (pages.py: faults cost more than hashing)
        return tensor

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class SourceTensor:
    """One tensor as stored in the checkpoint (native FP8 comes with its block scales)."""

    name: str
    tensor: torch.Tensor
    scale_inv: torch.Tensor | None
    path: Path


def iter_checkpoint(model_dir: str | Path, cfg: ModelConfig) -> Iterator[SourceTensor]:
    """Every tensor the model needs, one at a time, checked against the config."""
    with CheckpointReader(model_dir) as reader:
        for name, shape in wanted_shapes(cfg, reader).items():
            tensor, scale_inv = reader.get(name), None
            path = reader.files[name][0]
            if tensor.dtype == FP8:
                scale_name = name + SCALE_SUFFIX
                if cfg.fp8_block is None or scale_name not in reader:
                    raise CheckpointError(f"{path}: tensor {name} is float8 but has no {scale_name} block scales")
                scale_inv = reader.get(scale_name)
            elif not tensor.is_floating_point():
                raise CheckpointError(f"{path}: tensor {name} has dtype {tensor.dtype}, expected a float")
            if tuple(tensor.shape) != shape:
                raise CheckpointError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, config expects {shape}")
            yield SourceTensor(name, tensor, scale_inv, path)


def resolve_dtype(dtype: str | None, device: torch.device, cfg: ModelConfig) -> torch.dtype:
    """config.weights_dtype as a torch dtype."""
    return getattr(torch, weights_dtype(dtype, device.type, cfg))
