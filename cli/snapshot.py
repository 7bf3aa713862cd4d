"""`preload snapshot DIR` (experimental): a zygote whose imports are done, checkpointed with
CRIU into DIR, for `preload start --restore DIR` (preloadd/snapshot.py says how and what
it holds). Needs no daemon: the image is the same for every daemon of this install."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
def snapshot(dest):
    """Checkpoint a zygote, its imports done, into DEST (new, or an empty folder), for
    `preload start --restore DEST`. Needs CRIU 4.x (on PATH, or $PRELOAD_CRIU) and a host
    where `criu check` passes; exits 1 with CRIU's reason otherwise."""
    from preload.preloadd.snapshot import SnapshotError, take

    try:
        meta = take(dest.absolute())
    except SnapshotError as e:
        raise click.ClickException(f"no snapshot: {e}") from None
    click.echo(f"snapshot in {dest}: a zygote (pid {meta['pid']}) after {meta['import_seconds']:.2f} s of imports,"
               f" {meta['image_bytes'] / 1e6:.0f} MB of image, dumped in {meta['dump_seconds']:.2f} s (CRIU {meta['criu']})")
    click.echo(f"  preload start MODEL --restore {dest}")
