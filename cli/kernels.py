"""`preload kernels`: the workers' kernel cache, where it is and what it lists; and
`preload kernels compile`, which fills it from kernel lists without a GPU (an image build,
an init container, a host after an upgrade). kernels/ahead.py says how."""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import click

from preload.cli.options import state_dir_option, state_dir_path
from preload.preloadd.state_dir import KERNEL_CACHE_ENV, kernel_cache_dir

SOME_FAILED = 3  # the exit status when some kernels did not compile (the Dockerfile goes on; an error is 1)


def _cache(state_dir: Path | None) -> Path:
    return kernel_cache_dir(state_dir_path(state_dir))


@click.group(invoke_without_command=True)
@state_dir_option
@click.pass_context
def kernels(ctx, state_dir):
    """The workers' Triton kernel cache: where it is, and the kernels its list holds."""
    if ctx.invoked_subcommand is not None:
        return
    from preload.kernels import ahead

    cache = _cache(state_dir)
    path = ahead.list_path(cache)
    try:
        listed = ahead.read_list(path)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"kernel cache: {cache}" + ("" if os.environ.get(KERNEL_CACHE_ENV) else f" (${KERNEL_CACHE_ENV} moves it)"))
    click.echo(f"kernel list:  {path}: {len(listed)} kernels recorded by workers on a GPU"
               + ("" if listed else " (none yet: a worker's first start on a GPU writes it)"))
    by_name = collections.Counter(ahead.name_of(spec).rpartition(".")[2] for spec in listed.values())
    for name, count in sorted(by_name.items()):
        click.echo(f"  {count:4d}  {name}")


@kernels.command("compile")
@click.argument("lists", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@state_dir_option
@click.option("--processes", type=click.IntRange(min=1), default=None,
              help="Processes compiling at once (default: one per CPU this process may use).")
def compile_command(lists, state_dir, processes):
    """Compile the kernels of LISTS (files `preload kernels` names, from another host or an
    image's build context; default: this cache's own list) into this kernel cache, in
    parallel and without a GPU, and add them to its list. A worker's first start then finds
    them compiled. Exits 3 if some did not compile (the JIT compiles those at first use), 1 on an
    error (no list, a damaged one)."""
    cache = _cache(state_dir)
    os.environ[KERNEL_CACHE_ENV] = str(cache)  # (before Triton reads it)
    from preload.kernels import ahead

    specs: dict[str, str] = {}
    try:
        for path in lists or [ahead.list_path(cache)]:
            specs |= ahead.read_list(path)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if not specs:
        raise click.ClickException(f"no kernels listed in {', '.join(map(str, lists)) or ahead.list_path(cache)}")
    done = ahead.compile_list(list(specs.values()), processes)
    recorder = ahead.Recorder(cache)
    for spec in specs.values():
        if spec not in done.failed:
            recorder.add(spec)
    click.echo(f"compiled {done.kernels - len(done.failed)} of {done.kernels} kernels into {cache} in"
               f" {done.seconds:.1f} s ({done.processes} processes)")
    if done.host_code:
        click.echo(f"their launchers not built here ({done.host_code}): a first start on a GPU host builds them"
                   " while it loads")
    for why in done.failed.values():
        click.echo(f"  not compiled: {why}", err=True)
    sys.exit(SOME_FAILED if done.failed else 0)
