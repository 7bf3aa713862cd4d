"""Fixtures of the worker's HTTP tests: the model they serve and its vocabulary size."""

import json

import pytest
from workers import chat_model


@pytest.fixture(scope="module")
def model(request, tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("served") / "tiny-chat", lambda: request.getfixturevalue("tiny_checkpoint"))


@pytest.fixture(scope="module")
def vocab(model) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]
