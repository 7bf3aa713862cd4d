"""`preload bench`: benchmarks that print a table and write JSON (DESIGN.md, "Benchmarks")."""

from __future__ import annotations

import json
from pathlib import Path

import click

from preload.options import QUANT_MODES as QUANTS


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
@click.option("--transformers", "with_transformers", is_flag=True,
              help="Also time transformers from_pretrained on the same files (needs transformers).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench-cold.json"),
              show_default=True, help="Where to write the results.")
def cold(model, quant, repeat, device, evict, no_warmup, with_transformers, json_path):
    """Cold start: `preload start` to ready per quant mode, vs reading the checkpoint files alone."""
    from preload import BUNDLED_MODEL
    from preload.bench.cold import format_table, run_cold

    model = Path(model or BUNDLED_MODEL)
    try:
        result = run_cold(model, quant, repeat=repeat, device=device, evict=evict, warmup=not no_warmup,
                          transformers=with_transformers, progress=lambda msg: click.echo(f"... {msg}", err=True))
    except (OSError, RuntimeError, TimeoutError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(format_table(result))
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    click.echo(f"\nwrote {json_path}")


@bench.command("serve")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="A running worker (`preload serve`).")
@click.option("--requests", "n_requests", type=click.IntRange(1), default=64, show_default=True, help="Recorded requests.")
@click.option("--concurrency", type=click.IntRange(1), default=8, show_default=True, help="Clients sending at once.")
@click.option("--prompt-len", default="64:256", show_default=True, help="Prompt tokens, uniform in LO:HI (or one number).")
@click.option("--output-len", default="32:128", show_default=True, help="Output tokens, uniform in LO:HI (or one number).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--vocab", type=click.IntRange(1), default=None,
              help="Prompt token ids are drawn from [0, VOCAB) [default: found by asking the worker].")
@click.option("--warmup", type=click.IntRange(0), default=1, show_default=True, help="Unrecorded requests sent first.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds per request.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench-serve.json"),
              show_default=True, help="Where to write the results.")
def serve(url, n_requests, concurrency, prompt_len, output_len, seed, vocab, warmup, timeout, json_path):
    """Serving load: concurrent streamed completions against a running worker."""
    import asyncio

    import httpx

    from preload.bench.serve import format_table, parse_range, run_load

    try:
        p_len, o_len = parse_range(prompt_len), parse_range(output_len)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    try:
        result = asyncio.run(run_load(url, n_requests, concurrency, p_len, o_len, seed, vocab, warmup, timeout,
                                      progress=lambda msg: click.echo(f"... {msg}", err=True)))
    except (httpx.HTTPError, OSError, RuntimeError, ValueError) as e:
        raise click.ClickException(f"{url}: {e}") from None
    click.echo(format_table(result))
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    click.echo(f"\nwrote {json_path}")


@bench.command("restart")
@click.option("--restarts", type=click.IntRange(1), default=10, show_default=True, help="Restarts of each kind.")
@click.option("--cold-repeat", type=click.IntRange(1), default=3, show_default=True, help="Cold starts to time.")
@click.option("--small", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The small model [default: the bundled one, else a tiny random checkpoint].")
@click.option("--large", type=click.Path(file_okay=False, path_type=Path),
              default=Path("/tmp/preload-bench-restart/v2-lite-mini"), show_default=True,
              help="The ~1.2 GB model; written there (V2-Lite shapes, random weights) unless it exists.")
@click.option("--no-large", is_flag=True, help="Only the small model.")
@click.option("--no-small", is_flag=True, help="Only the large model.")
@click.option("--memory-workers", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Also measure memory (host, and device on CUDA) with this many workers (--spare-workers 0).")
@click.option("--device", default="auto", show_default=True, help="Passed to `preload start --device`.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench-restart.json"),
              show_default=True, help="Where to write the results.")
def restart(restarts, cold_repeat, small, large, no_large, no_small, memory_workers, device, json_path):
    """Restart: worker SIGKILL (a warm spare takes over, a zygote fork, no zygote) / `preload restart`
    to /health 200 from the new worker, vs cold start; host and device memory with 1 and N workers."""
    import tempfile

    from preload.bench.restart import format_table, large_model, run_restart, small_model

    progress = lambda msg: click.echo(f"... {msg}", err=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="preload-bench-restart-models-") as work:
        models = [] if no_small else [("small", small) if small else small_model(Path(work))]
        if not no_large:
            progress(f"large model: {large}")
            models.append(large_model(large))
        if not models:
            raise click.UsageError("--no-small and --no-large leave nothing to measure")
        try:
            result = run_restart(models, restarts, cold_repeat, memory_workers, device, progress)
        except (OSError, RuntimeError, TimeoutError) as e:
            raise click.ClickException(str(e)) from None
    click.echo(format_table(result))
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    click.echo(f"\nwrote {json_path}")
