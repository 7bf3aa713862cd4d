"""Bad input to `preload start` gets a clear error and loses nothing: the command exits
non-zero with ONE line on stderr naming the file (and the tensor where one is at
fault), and leaves no control sockets, no daemon process, no lock and no taken port.

Every bad checkpoint is started through the real CLI in a subprocess. The starts run
concurrently (one module fixture), since each costs an `import torch`; each test
then checks one of them.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from daemons import PRELOAD, START_TIMEOUT, daemon_processes, free_port, port_is_free, preload, sockets_in, stop_everything
from safetensors.torch import load_file, save_file

from preload.preloadd.copy_loader import check_memory
from preload.preloadd.weights import LoadError

DENSE = "model.layers.0.mlp.down_proj.weight"
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"
ATTENTION = "model.layers.2.self_attn.kv_b_proj.weight"
FIRST = "lm_head.weight"  # stored first: its bytes start at data offset 0


def copy_of(ckpt: Path, work: Path) -> Path:
    return Path(shutil.copytree(ckpt, work / "model"))


def edit_config(model: Path, **changes) -> None:
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | changes, indent=2))


def edit_tensors(model: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = model / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_header(model: Path, edit: Callable[[dict], None]) -> None:
    """Change the JSON header in place, keeping its length (padded with spaces, as
    the format allows) so that every other byte of the file stays where it was."""
    path = model / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n, "test setup: the edited header must not grow"
    path.write_bytes(raw[:8] + new.ljust(n, b" ") + raw[8 + n :])


def data_size(model: Path) -> int:
    raw = (model / "model.safetensors").read_bytes()
    return len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]


# Each case makes a bad checkpoint from a good one and says what the error line must
# name: every entry must appear; a tuple entry is satisfied by any one of its strings.
Expect = list[str | tuple[str, ...]]


def missing_dir(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    model = work / "no-such-checkpoint"
    return model, [str(model)]


def missing_config(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    model = copy_of(ckpt, work)
    (model / "config.json").unlink()
    return model, [str(model / "config.json")]


def malformed_config(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    model = copy_of(ckpt, work)
    (model / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"], ')
    return model, [str(model / "config.json")]


def unsupported_architecture(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    model = copy_of(ckpt, work)
    edit_config(model, architectures=["LlamaForCausalLM"], model_type="llama")
    return model, [str(model / "config.json"), "LlamaForCausalLM"]


def no_weight_files(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    model = copy_of(ckpt, work)
    (model / "model.safetensors").unlink()
    return model, [str(model), "safetensors"]


def truncated_file(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    model = copy_of(ckpt, work)
    path = model / "model.safetensors"
    os.truncate(path, path.stat().st_size // 2)
    return model, [str(path)]


def offsets_beyond_the_file(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    """One tensor's data_offsets point past the end of the file; every other entry is intact."""
    model = copy_of(ckpt, work)
    end = data_size(model)

    def lie(header):
        start, stop = header[EXPERT]["data_offsets"]
        header[EXPERT]["data_offsets"] = [end + 4096, end + 4096 + stop - start]

    edit_header(model, lie)
    return model, [str(model / "model.safetensors"), EXPERT]


def offsets_overlapping(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    """One tensor's data_offsets claim the bytes of the first tensor in the file."""
    model = copy_of(ckpt, work)

    def lie(header):
        start, stop = header[EXPERT]["data_offsets"]
        header[EXPERT]["data_offsets"] = [0, stop - start]

    edit_header(model, lie)
    return model, [str(model / "model.safetensors"), (EXPERT, FIRST)]


def wrong_shape(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    model = copy_of(ckpt, work)

    def narrow(tensors):
        tensors[DENSE] = tensors[DENSE][:, :-1].contiguous()

    edit_tensors(model, narrow)
    return model, [str(model / "model.safetensors"), DENSE]


def wrong_dtype(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    model = copy_of(ckpt, work)

    def to_int(tensors):
        tensors[DENSE] = tensors[DENSE].to(torch.int32)

    edit_tensors(model, to_int)
    return model, [str(model / "model.safetensors"), DENSE]


def missing_tensor(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    model = copy_of(ckpt, work)
    edit_tensors(model, lambda tensors: tensors.pop(ATTENTION))
    return model, [str(model), ATTENTION]


def poisoned_weight(tensor: str, value: float, word: str):
    """One NaN or Inf in one weight: it would load, warm up, report healthy and fail every request."""

    def make(ckpt: Path, work: Path) -> tuple[Path, Expect]:
        model = copy_of(ckpt, work)

        def poison(tensors):
            tensors[tensor] = tensors[tensor].clone()
            tensors[tensor].view(-1)[7] = value

        edit_tensors(model, poison)
        return model, [tensor, word]

    make.__name__ = f"{word.lower()}_weight"
    return make


def too_little_memory(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    """A config whose vocabulary makes the arena ~512 TiB: the daemon must see that it
    cannot fit before allocating or reading anything."""
    model = copy_of(ckpt, work)
    edit_config(model, vocab_size=2**40)
    return model, ["memory"]


def absurd_layer_count(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    """10^9 layers in config.json (issue 36: the daemon listed their tensors for minutes,
    holding gigabytes, and `preload start` never returned)."""
    model = copy_of(ckpt, work)
    edit_config(model, num_hidden_layers=10**9)
    return model, ["num_hidden_layers"]


def absurd_expert_count(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    model = copy_of(ckpt, work)
    edit_config(model, n_routed_experts=2**30, n_group=1, topk_group=1)
    return model, ["n_routed_experts"]


def size_not_a_number(ckpt: Path, work: Path) -> tuple[Path, Expect]:
    """(It said "bad operand type for unary -".)"""
    model = copy_of(ckpt, work)
    edit_config(model, hidden_size="abc")
    return model, ["hidden_size", "config.json"]


CASES = {
    f.__name__.replace("_", "-"): f
    for f in (
        missing_dir,
        missing_config,
        malformed_config,
        unsupported_architecture,
        no_weight_files,
        truncated_file,
        offsets_beyond_the_file,
        offsets_overlapping,
        wrong_shape,
        wrong_dtype,
        missing_tensor,
        poisoned_weight(DENSE, float("nan"), "NaN"),
        poisoned_weight(EXPERT, float("-inf"), "Inf"),
        too_little_memory,
        absurd_layer_count,
        absurd_expert_count,
        size_not_a_number,
    )
}


class FailedStart:
    def __init__(self, model: Path, expect: Expect, state_dir: Path, port: int):
        self.model, self.expect, self.state_dir, self.port = model, expect, state_dir, port
        self.proc = subprocess.Popen(
            [PRELOAD, "start", "--model", str(model), "--state-dir", str(state_dir), "--health-port", str(port),
             "--workers", "0"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout = self.stderr = ""

    def wait(self) -> None:
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.stdout, self.stderr = self.proc.communicate()


@pytest.fixture(scope="module")
def failed_starts(tiny_checkpoint, tmp_path_factory):
    starts = {}
    try:
        for name, make in CASES.items():
            work = tmp_path_factory.mktemp(name)
            model, expect = make(tiny_checkpoint, work)
            starts[name] = FailedStart(model, expect, work / "state", free_port())
        for start in starts.values():
            start.wait()
        yield starts
    finally:
        for start in starts.values():
            if start.proc.poll() is None:
                start.proc.kill()
                start.proc.wait()
            stop_everything(start.state_dir)


def lock_is_free(state_dir: Path) -> bool:
    lock = state_dir / "daemon.lock"
    if not lock.exists():
        return True
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_checkpoint_fails_with_one_line_and_leaves_nothing(case, failed_starts):
    start = failed_starts[case]
    assert start.proc.returncode not in (0, None), f"preload start succeeded on {case}:\n{start.stdout}"
    lines = start.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one error line, got {len(lines)}:\n{start.stderr}"
    line = lines[0]
    for want in start.expect:
        options = (want,) if isinstance(want, str) else want
        assert any(o in line for o in options), f"the error line should name {' or '.join(options)}: {line}"
    assert sockets_in(start.state_dir) == [], "control sockets left behind"
    assert daemon_processes(start.state_dir) == [], "a daemon process was left running"
    assert lock_is_free(start.state_dir), "the state dir's lock is still held"
    assert port_is_free(start.port), "the health port is still taken"


def test_unknown_quant_mode_is_a_usage_error(tiny_checkpoint, tmp_path):
    state_dir = tmp_path / "state"
    r = preload("start", "--model", tiny_checkpoint, "--state-dir", state_dir, "--quant", "int3", "--health-port", free_port())
    assert r.returncode == 2  # click's usage error
    assert "'--quant'" in r.stderr and "int3" in r.stderr
    assert all(q in r.stderr for q in ("none", "fp8_per_tensor", "fp8_block")), "the error should list the valid modes"
    assert not state_dir.exists() or sockets_in(state_dir) == []
    assert daemon_processes(state_dir) == []


def test_check_memory_refuses_an_arena_larger_than_available_memory():
    """Directly, because another process's free memory cannot be faked from a test;
    the end-to-end case above (`too-little-memory`) uses an absurd config instead."""
    available = psutil.virtual_memory().available
    with pytest.raises(LoadError, match="memory"):
        check_memory(available + 2**30, "cpu")
    check_memory(1 << 20, "cpu")  # a small arena passes
