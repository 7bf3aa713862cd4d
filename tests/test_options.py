"""Every option is defined once (preload/options.py): the command line is generated from
those dataclasses, with their defaults, and the options travel to the detached daemon
and to the zygote as JSON that turns back into the same dataclass."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click
import pytest

from preload.cli.options import build
from preload.cli.serve import serve
from preload.cli.start import start
from preload.options import (
    DaemonOptions,
    EngineOptions,
    ServeOptions,
    WorkerOptions,
    cli_fields,
    from_json,
    parse_size,
    to_json,
)


def parse(command: click.Command, *args: str) -> dict:
    return command.make_context(command.name, list(args)).params


@pytest.mark.parametrize("cls, command", [(DaemonOptions, start), (ServeOptions, serve)])
def test_every_field_is_an_option_with_the_dataclass_default(cls, command):
    by_name = {p.name: p for p in command.params}
    for path, f, _ in cli_fields(cls):
        param = by_name["__".join(path)]
        assert param.opts[0].startswith("--" + f.name.replace("_", "-")), param.opts
        assert param.help == f.metadata["help"] and param.help, f.name
        show = f.metadata["show"]
        assert param.default == (show(f.default) if show else f.default), f.name
    # nothing on the command line that is not in the dataclass (but --foreground)
    known = {"__".join(path) for path, _, _ in cli_fields(cls)}
    assert set(by_name) - known <= {"foreground", "model_dir"}  # (MODEL: --model's positional spelling)


def test_no_arguments_give_the_dataclass_defaults():
    options = build(DaemonOptions, parse(start))
    assert replace(options, state_dir=None) == DaemonOptions()
    assert options.state_dir.is_absolute()
    assert replace(build(ServeOptions, parse(serve)), state_dir=None) == ServeOptions()


def test_arguments_land_in_the_nested_dataclasses(tmp_path):
    options = build(DaemonOptions, parse(
        start, "--model", str(tmp_path), "--workers", "3", "--no-zygote", "--allow-uid", "5", "--allow-uid", "6",
        "--kv-cache-memory", "1GiB", "--max-num-seqs", "7", "--drain-timeout", "2.5", "--max-request-bytes", "1MiB",
        "--trust-request-chat-template", "--worker-timeout", "9"))
    assert (options.model, options.workers, options.zygote, options.allow_uid) == (tmp_path, 3, False, (5, 6))
    assert options.worker == WorkerOptions(drain_timeout=2.5, max_request_bytes=1 << 20, trust_request_chat_template=True,
                                           engine=EngineOptions(kv_cache_memory=1 << 30, max_num_seqs=7))
    assert options.worker_timeout == 9.0


def test_bad_values_are_refused_naming_the_option():
    for args, name in [(("--kv-cache-memory", "lots"), "--kv-cache-memory"), (("--workers", "65"), "--workers"),
                       (("--quant", "int3"), "--quant"), (("--gpu-memory-utilization", "2"), "--gpu-memory-utilization")]:
        with pytest.raises(click.BadParameter) as e:
            parse(start, *args)
        assert name in e.value.format_message() or name == "--" + e.value.param.name.split("__")[-1].replace("_", "-")


def test_json_round_trip_gives_the_same_options(tmp_path):
    options = DaemonOptions(model=tmp_path, state_dir=tmp_path / "s", allow_gid=(3,), spare_workers=2,
                            worker=WorkerOptions(served_model_name=("m", "n"), engine=EngineOptions(kv_cache_dtype="fp8")))
    again = from_json(DaemonOptions, to_json(options))
    assert again == options and isinstance(again.model, Path) and again.allow_gid == (3,)
    with pytest.raises(ValueError, match="unknown options"):
        from_json(DaemonOptions, to_json(options) | {"frobnicate": 1})


@pytest.mark.parametrize("text, value", [("512MiB", 512 << 20), ("2GiB", 2 << 30), ("5GB", 5 * 10**9), ("1024", 1024),
                                         ("1.5k", 1536), ("4 MiB", 4 << 20)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1MiB", "1TiB", "MiB"])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        parse_size(text)
