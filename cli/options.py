"""The command line's options, generated from the option dataclasses in preload/options.py.

Each command-line field becomes one click option named after it (`max_num_seqs` ->
`--max-num-seqs`), with its type, bounds, choices, default and help from the field;
`build` turns the parsed values back into the dataclass.
"""

from __future__ import annotations

import types
import typing
from dataclasses import replace
from pathlib import Path

import click

from preload.ipc.protocol import default_state_dir
from preload.options import STATE_DIR_HELP, cli_fields, from_paths


def _param(path: tuple[str, ...]) -> str:
    return "__".join(path)


def _click_type(f, kind):
    meta = f.metadata
    if meta["parse"] is not None:
        return str  # parsed by the callback below
    if meta["choices"]:
        return click.Choice(meta["choices"])
    base = next((a for a in typing.get_args(kind) if a is not type(None)), kind) if isinstance(kind, types.UnionType) else kind
    if typing.get_origin(base) is tuple:
        base = typing.get_args(base)[0]
    if meta["bounds"] and base in (int, float):
        lo, hi = meta["bounds"]
        return (click.IntRange if base is int else click.FloatRange)(lo, hi)
    if base is Path:
        return click.Path(path_type=Path, file_okay=f.name != "state_dir")
    return base


def _option(path: tuple[str, ...], f, kind):
    meta = f.metadata
    flag = meta["flag"] or "--" + f.name.replace("_", "-")
    kw = {"help": meta["help"], "default": f.default, "show_default": f.default is not None and f.default != ()}
    if kind is bool:
        kw |= {"is_flag": True, "show_default": False}
    else:
        kw["type"] = _click_type(f, kind)
    if typing.get_origin(kind) is tuple:
        kw |= {"multiple": True, "show_default": False}
    if meta["parse"] is not None:
        kw["default"] = meta["show"](f.default)
        kw["show_default"] = True

        def parse(ctx, param, value, parse=meta["parse"]):
            try:
                return parse(value)
            except ValueError as e:
                raise click.BadParameter(str(e)) from None

        kw["callback"] = parse
    return click.option(flag, _param(path), **kw)


def options_of(cls, exclude: tuple[str, ...] = ()):
    """A decorator adding an option for every command-line field of `cls` (except the
    fields named in `exclude`) to a click command."""

    def decorate(command):
        for path, f, kind in reversed(cli_fields(cls)):
            if f.name not in exclude:
                command = _option(path, f, kind)(command)
        return command

    return decorate


def build(cls, params: dict, create_state_dir: bool = False):
    """The dataclass from a command's parsed parameters (as `options_of` named them);
    a relative state dir or model dir is made absolute (the daemon runs elsewhere).
    `create_state_dir`: the default state dir is made if there is none (preload start)."""
    known = {_param(path): path for path, _, _ in cli_fields(cls)}
    options = from_paths(cls, {known[name]: value for name, value in params.items() if name in known})
    model = options.model and Path(options.model).absolute()
    return replace(options, state_dir=state_dir_path(options.state_dir, create_state_dir), model=model)


def state_dir_path(value: Path | None, create: bool = False) -> Path:
    return (Path(value) if value else default_state_dir(create)).absolute()


state_dir_option = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help=STATE_DIR_HELP,
)
