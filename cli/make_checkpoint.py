"""`preload make-checkpoint`: random-weight checkpoints in HF layout with real models' shapes."""

from __future__ import annotations

from pathlib import Path

import click

from preload.options import parse_size


@click.command("make-checkpoint")
@click.option("--shape", type=click.Choice(["v2-lite", "v2-lite-mini", "v3-slice", "v3-draft"]), required=True,
              help="v2-lite: DeepSeek-V2-Lite (27 layers, 64 experts, ~31 GB bf16); v2-lite-mini: its shapes cut to "
                   "2 layers and 8 experts (~1.2 GB); v3-slice: DeepSeek-V3's layer shapes, 1 dense + --moe-layers MoE "
                   "(and the MTP layer); v3-draft: a 2-layer model of V3's vocabulary (~0.6 GB), a draft for v3-slice.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--moe-layers", type=click.IntRange(1, 3), default=1, show_default=True, help="MoE layers of v3-slice.")
@click.option("--shard-size", default="5GB", show_default=True, help="Largest safetensors file.")
@click.option("--seed", type=int, default=0, show_default=True)
def make_checkpoint(shape, out, moe_layers, shard_size, seed):
    """Write a synthetic checkpoint that stands in for a real one of the same shapes."""
    from preload.bench.checkpoint import SHAPES, make_random_checkpoint

    config = SHAPES[shape](moe_layers)
    try:
        size = parse_size(shard_size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--shard-size") from None
    make_random_checkpoint(out, config, size, seed=seed, with_mtp=shape == "v3-slice")
    total = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    click.echo(f"wrote {out} ({total / 1e9:.2f} GB)")
