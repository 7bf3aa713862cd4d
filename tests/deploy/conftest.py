"""What the deploy files are checked against: the repository's own files, read as the
tools that consume them would (no Docker daemon, cluster or systemd needed). Fixtures
only: test modules here are not importable by name (tests/conftest.py owns that name)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def dockerfile() -> list[tuple[str, str]]:
    """deploy/Dockerfile as (INSTRUCTION, arguments) in order, continuation lines joined
    and comments (parser directives too) dropped, as Docker's parser reads it."""
    instructions, pending = [], ""
    for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or (not pending and not line.strip()):
            continue  # (a comment inside a continued instruction is dropped too)
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        instruction, _, args = (pending + line).strip().partition(" ")
        instructions.append((instruction.upper(), " ".join(args.split())))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return instructions


@pytest.fixture(scope="session")
def image_user(dockerfile) -> tuple[int, int]:
    """The uid and gid the image runs as: its last USER, which must be numeric."""
    users = [args for instruction, args in dockerfile if instruction == "USER"]
    assert users, "the image has no USER: it would run as root"
    m = re.fullmatch(r"(\d+):(\d+)", users[-1])
    assert m, f"USER {users[-1]}: give a numeric uid:gid, which Kubernetes' runAsNonRoot can check"
    return int(m.group(1)), int(m.group(2))


@pytest.fixture(scope="session")
def start_flags() -> set[str]:
    """Every option `preload start` accepts, from the command itself (as --help lists them)."""
    from preload.cli.main import main

    command = main.get_command(None, "start")
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts)}
