"""Command-line options shared by several `preload` subcommands."""

from __future__ import annotations

from pathlib import Path

import click

from preload.ipc.protocol import default_state_dir

state_dir_option = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Daemon state dir [default: $XDG_RUNTIME_DIR/preload, else /tmp/preload-$UID].",
)


def state_dir_path(value: Path | None) -> Path:
    return (value or default_state_dir()).absolute()


def parse_size(text: str, option: str = "size") -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    t = text.strip().lower()
    number = t.rstrip("kmgib")
    try:
        return int(float(number) * units[t[len(number):]])
    except (ValueError, KeyError):
        raise click.BadParameter(f"{option}: {text!r} is not a size like 512MiB or 2GiB") from None


def engine_options(f):
    """Options of the engine a worker runs, shared by `preload serve` and `preload start --workers`."""
    for option in reversed([
        click.option("--served-model-name", default=None, help="Model id in the API [default: checkpoint dir name]."),
        click.option("--kv-cache-memory", default="auto", show_default=True,
                     help="Bytes of latent KV cache per worker; auto: on a GPU, each worker's share of what the weights"
                          " leave within --gpu-memory-utilization, 512MiB on CPU."),
        click.option("--gpu-memory-utilization", type=click.FloatRange(0.05, 1.0), default=0.9, show_default=True,
                     help="Fraction of the GPU that weights, workers and their KV caches may use (auto KV cache)."),
        click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True),
        click.option("--block-size", type=click.IntRange(1, 1024), default=16, show_default=True),
        click.option("--max-num-seqs", type=click.IntRange(1), default=256, show_default=True),
        click.option("--max-num-batched-tokens", type=click.IntRange(1), default=2048, show_default=True),
        click.option("--drain-timeout", type=float, default=30.0, show_default=True, help="Seconds to finish requests on SIGTERM."),
        click.option("--max-request-bytes", default="4MiB", show_default=True),
        click.option("--trust-request-chat-template", is_flag=True, help="Let requests supply chat_template / chat_template_kwargs."),
    ]):
        f = option(f)
    return f


def serve_options(state_dir: Path, model: Path | None, host: str, port: int, p: dict):
    """ServeOptions from the values of `engine_options`."""
    from preload.worker.engine import EngineConfig
    from preload.worker.serve import ServeOptions

    kv = None if p["kv_cache_memory"].strip().lower() == "auto" else parse_size(p["kv_cache_memory"], "--kv-cache-memory")
    engine = EngineConfig(kv, p["kv_cache_dtype"], p["block_size"], p["max_num_seqs"], p["max_num_batched_tokens"])
    return ServeOptions(state_dir, model, host, port, p["served_model_name"], engine, p["trust_request_chat_template"],
                        p["drain_timeout"], parse_size(p["max_request_bytes"], "--max-request-bytes"),
                        p["gpu_memory_utilization"])
