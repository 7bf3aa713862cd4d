"""The `preload` command. Subcommands are registered here by name and imported only
when run, so `preload --help` and `preload status` never pay for importing torch."""

from __future__ import annotations

import importlib
import os

import click

# Idle OpenMP threads that spin make every engine step many times slower when other
# processes share the cores (workers, the zygote, tests): let them sleep instead. Set
# before anything imports torch; children (daemon, zygote, workers) inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

COMMANDS = {
    "bench": ("preload.cli.bench", "bench", "Benchmarks: print a table, write JSON."),
    "demo": ("preload.cli.demo", "demo", "Show the product on the bundled model."),
    "kernels": ("preload.cli.kernels", "kernels", "The workers' kernel cache; compile it ahead from kernel lists."),
    "make-checkpoint": ("preload.cli.make_checkpoint", "make_checkpoint", "Write a random checkpoint with real models' shapes."),
    "restart": ("preload.cli.daemon", "restart", "Replace the daemon's workers (rolling, or --now)."),
    "serve": ("preload.cli.serve", "serve", "Serve the OpenAI-compatible API from the daemon's weights."),
    "snapshot": ("preload.cli.snapshot", "snapshot", "Checkpoint a zygote, imports done, for start --restore (CRIU)."),
    "sleep": ("preload.cli.daemon", "sleep", "Free the device: the workers' engines stop until `preload wake`."),
    "start": ("preload.cli.start", "start", "Start the daemon: load a checkpoint once, keep it resident."),
    "status": ("preload.cli.daemon", "status", "Show what the daemon holds and who is attached."),
    "stop": ("preload.cli.daemon", "stop", "Stop the daemon."),
    "wake": ("preload.cli.daemon", "wake", "Serve again after `preload sleep`."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][2]) for name in sorted(COMMANDS)])


@click.group(cls=LazyGroup)
@click.version_option(package_name="preload", prog_name="preload")
def main() -> None:
    """preload: DeepSeek-family MoE weights loaded once, engine workers attached zero-copy."""


if __name__ == "__main__":
    main()
