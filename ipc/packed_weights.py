"""A checkpoint's weights packed as the daemon's arena packs them, and loaded so in-process.

The daemon's loader writes every stored tensor (quantized as asked) at the offsets
`stored_specs_of` + `layout.pack` give. A process that loads a checkpoint itself (the
offline `LLM`, a draft model) loads it into one buffer of its own laid out the same way,
so that there too a MoE layer's experts lie evenly spaced and the GPU kernels take them as
one [E, ...] tensor without a copy (kernels/fused_moe.stack_experts). Loaded one tensor
at a time instead, the experts were stacked again at first use: a second copy of every
routed expert (v3-slice on an 80 GB H100: 45 GiB of weights, then out of memory
stacking the first 7 GiB of them).
"""

from __future__ import annotations

from pathlib import Path

import torch

from preload.checkpoint.config import ModelConfig
from preload.checkpoint.reader import CheckpointReader, iter_checkpoint
from preload.checkpoint.shapes import wanted_shapes
from preload.ipc.layout import check_planned, pack
from preload.ipc.views import tensor_views
from preload.kernels.precision import stored_specs
from preload.kernels.quant import quantize_weight


def stored_specs_of(cfg: ModelConfig, model_dir: Path, quant: str, dtype: torch.dtype) -> list[tuple[str, str, tuple]]:
    """(name, torch dtype name, shape) of every tensor stored for the checkpoint, in the
    checkpoint's order (a layer's experts one after another)."""
    with CheckpointReader(model_dir) as reader:
        shapes = wanted_shapes(cfg, reader)
    dtype_name = str(dtype).removeprefix("torch.")
    return [(name, stored_dtype, stored_shape) for source, shape in shapes.items()
            for name, (stored_dtype, stored_shape) in stored_specs(source, shape, quant, dtype_name).items()]


def load_checkpoint(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu",
                    quant: str = "none") -> dict[str, torch.Tensor]:
    """Every tensor the model needs, quantized as asked, on `device`: views of one buffer
    laid out as an arena is; peak memory the buffer and one tensor in flight."""
    entries, size = pack(stored_specs_of(cfg, Path(model_dir), quant, dtype))
    weights = tensor_views(torch.empty(size, dtype=torch.uint8, device=device), entries)
    by_name = {e.name: e for e in entries}
    for src in iter_checkpoint(model_dir, cfg):
        scale = None if src.scale_inv is None else src.scale_inv.to(device)
        for name, tensor in quantize_weight(src.name, src.tensor.to(device), scale, cfg.fp8_block, quant, dtype).items():
            check_planned(by_name[name], tensor)
            weights[name].copy_(tensor)
    return weights
