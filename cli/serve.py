"""`preload serve`: one engine worker attached to a running daemon."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from preload.cli.options import engine_options, serve_options, state_dir_option, state_dir_path


@click.command()
@state_dir_option
@click.option("--model", type=click.Path(path_type=Path), default=None,
              help="Refuse to start unless the daemon holds exactly this checkpoint.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@engine_options
def serve(state_dir, model, host, port, **engine):
    """Serve the OpenAI-compatible API from the daemon's weights."""
    import logging

    from preload.ipc.client import DaemonError, DaemonUnavailable
    from preload.ipc.identity import IdentityError
    from preload.worker.serve import serve as run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run(serve_options(state_dir_path(state_dir), model, host, port, engine))
    except (DaemonUnavailable, DaemonError, IdentityError, OSError, ValueError) as e:
        click.echo(f"preload: {e}", err=True)
        sys.exit(1)
