"""`preload serve`: one engine worker attached to a running daemon."""

from __future__ import annotations

import sys

import click

from preload.cli.options import build, options_of
from preload.options import ServeOptions


@click.command()
@options_of(ServeOptions)
def serve(**params):
    """Serve the OpenAI-compatible API from the daemon's weights."""
    import logging

    from preload.checkpoint.identity import IdentityError
    from preload.ipc.client import DaemonError, DaemonUnavailable
    from preload.worker.serve import serve as run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run(build(ServeOptions, params))
    except (DaemonUnavailable, DaemonError, IdentityError, OSError, ValueError) as e:
        click.echo(f"preload: {e}", err=True)
        sys.exit(1)
