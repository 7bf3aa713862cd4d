"""`preload bench`: benchmarks that print a table and write JSON (DESIGN.md, "Benchmarks")."""

from __future__ import annotations

import json
from pathlib import Path

import click

QUANTS = ("none", "fp8_per_tensor", "fp8_block")


def _quant_list(ctx, param, value: str) -> list[str]:
    quants = [q.strip() for q in value.split(",") if q.strip()]
    bad = [q for q in quants if q not in QUANTS]
    if bad or not quants:
        raise click.BadParameter(f"{', '.join(bad) or value!r}: choose from {', '.join(QUANTS)}")
    return quants


@click.group()
def bench() -> None:
    """Benchmarks: print a table, write JSON."""


@bench.command()
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Checkpoint dir [default: the bundled model].")
@click.option("--quant", default=",".join(QUANTS), show_default=True, callback=_quant_list,
              help="Comma-separated quant modes to start the daemon with.")
@click.option("--repeat", type=click.IntRange(1), default=3, show_default=True, help="Runs per measurement.")
@click.option("--device", default="auto", show_default=True, help="Passed to `preload start --device`.")
@click.option("--evict", is_flag=True, help="Drop the checkpoint from the page cache before the first read.")
@click.option("--no-warmup", is_flag=True, help="Skip the unrecorded warm-up launch.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench-cold.json"),
              show_default=True, help="Where to write the results.")
def cold(model, quant, repeat, device, evict, no_warmup, json_path):
    """Cold start: `preload start` to ready per quant mode, vs reading the checkpoint files alone."""
    from preload import BUNDLED_MODEL
    from preload.bench.cold import format_table, run_cold

    model = Path(model or BUNDLED_MODEL)
    try:
        result = run_cold(model, quant, repeat=repeat, device=device, evict=evict, warmup=not no_warmup,
                          progress=lambda msg: click.echo(f"... {msg}", err=True))
    except (OSError, RuntimeError, TimeoutError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(format_table(result))
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    click.echo(f"\nwrote {json_path}")
