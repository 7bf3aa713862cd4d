"""Fixtures of the worker's HTTP tests: the model they serve, its vocabulary size, and a
daemon holding it in float32 (a module's own)."""

import json

import pytest
from daemons import running_daemon
from workers import chat_model


@pytest.fixture(scope="module")
def model(request, tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("served") / "tiny-chat", lambda: request.getfixturevalue("tiny_checkpoint"))


@pytest.fixture(scope="module")
def vocab(model) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def daemon(model, tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("server") / "state", model, "--dtype", "float32") as d:
        yield d
