"""`attach(state_dir)` and `LLM(..., state_dir=...)` against a real daemon: several
processes share one read-only copy of the weights, nobody can change them, a killed
worker costs the daemon nothing, and an attached LLM computes what the in-process
LLM computes (same tokens, same log-probs up to float rounding) in every quant mode."""

from __future__ import annotations

import faulthandler
import fcntl
import hashlib
import json
import mmap
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from contextlib import ExitStack

import pytest
import torch
from checkpoints import VOCAB
from daemons import running_daemon, wait_for
from safetensors.torch import load_file

from preload import LLM, attach
from preload.ipc.client import DaemonClient
from preload.ipc.memfd import MEMFD_SEALS

QUANTS = ("none", "fp8_per_tensor", "fp8_block")


def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def digests(weights) -> dict[str, str]:
    return {name: tensor_digest(weights[name]) for name in weights}


@pytest.fixture(scope="module")
def daemons(tiny_checkpoint, tmp_path_factory):
    """daemons(quant) -> a daemon serving the tiny checkpoint in float32 with that
    quant mode; started on first use, shared by the module, stopped at its end."""
    with ExitStack() as stack:
        started = {}

        def get(quant: str = "none"):
            if quant not in started:
                state_dir = tmp_path_factory.mktemp(f"attach-{quant}") / "state"
                started[quant] = stack.enter_context(
                    running_daemon(state_dir, tiny_checkpoint, "--dtype", "float32", quant=quant)
                )
            return started[quant]

        yield get


# A zygote, as the daemon's supervisor will have: it pays for `import torch` once,
# then on "go" forks N workers that attach at the same moment. Each prints one line
# (shorter than PIPE_BUF, so lines do not interleave) and stays attached until it
# reads its byte from the shared stdin; then it lets go.
ZYGOTE = r"""
import hashlib, json, os, sys
import torch
from preload import attach
n, state_dir = int(sys.argv[1]), sys.argv[2]
print("imported", flush=True)
sys.stdin.buffer.raw.read(1)
children = []
for _ in range(n):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            weights = attach(state_dir)
            summary = hashlib.sha256()
            for name in sorted(weights):
                t = weights[name].reshape(-1).view(torch.uint8)
                summary.update(f"{name}:{hashlib.sha256(t.numpy().tobytes()).hexdigest()};".encode())
            line = json.dumps({"pid": os.getpid(), "fingerprint": weights.fingerprint, "tensors": summary.hexdigest()})
            os.write(1, (line + "\n").encode())
            os.read(0, 1)
            weights.close()
            code = 0
        finally:
            os._exit(code)
    children.append(pid)
sys.exit(max(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in children))
"""


def summary_digest(tensors: dict[str, torch.Tensor]) -> str:
    summary = hashlib.sha256()
    for name in sorted(tensors):
        summary.update(f"{name}:{tensor_digest(tensors[name])};".encode())
    return summary.hexdigest()


def spawn(script: str, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def reap(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_four_processes_attach_at_once_and_see_the_same_weights(daemons, tiny_checkpoint):
    d = daemons("none")
    zygote = spawn(ZYGOTE, 4, d.state_dir)
    try:
        assert zygote.stdout.readline().strip() == "imported", zygote.stderr.read()
        zygote.stdin.write("g")  # go: four workers attach together
        zygote.stdin.flush()
        results = []
        for _ in range(4):
            line = zygote.stdout.readline()
            assert line, zygote.stderr.read()
            results.append(json.loads(line))
        pids = {r["pid"] for r in results}
        assert len(pids) == 4
        assert set(d.status()["attached_workers"]) >= pids
        zygote.stdin.write("llll")  # leave
        zygote.stdin.flush()
        assert zygote.wait(timeout=60) == 0, zygote.stderr.read()
    finally:
        reap([zygote])

    fingerprint = d.status()["fingerprint"]
    assert all(r["fingerprint"] == fingerprint for r in results)
    assert all(r["tensors"] == results[0]["tensors"] for r in results)
    # quant none in the checkpoint's own dtype: the attached bytes are the checkpoint's bytes
    assert results[0]["tensors"] == summary_digest(load_file(tiny_checkpoint / "model.safetensors"))
    # they said goodbye (`close`): none of them is listed as attached any more
    assert not set(d.status()["attached_workers"]) & pids


def test_attach_and_close_register_and_release_this_process(daemons):
    d = daemons("none")
    attaches = d.metrics()["preload_attaches_total"]
    with attach(d.state_dir) as weights:
        assert weights.fingerprint == d.status()["fingerprint"]
        assert weights.manifest.quant == "none"
        assert os.getpid() in d.status()["attached_workers"]
        assert d.metrics()["preload_attaches_total"] == attaches + 1
    assert os.getpid() not in d.status()["attached_workers"]


def fork(fn, *args) -> tuple[int, int]:
    """fn(report, *args) in a forked child of this process (torch is imported already,
    so no fresh interpreter to pay for); `report(text)` sends a line to the test.
    Returns the child's pid and the read end of its report pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            faulthandler.disable()  # a SIGSEGV may be the expected end; no dump
            fn(lambda text: os.write(w, (text + "\n").encode()), *args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def read_line(fd: int, timeout: float = 30) -> str:
    line = b""
    while not line.endswith(b"\n") and select.select([fd], [], [], timeout)[0]:
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    return line.decode().strip()


def end(pid: int, timeout: float = 30) -> int:
    """The child's wait status, killing it if it outlives `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def write_into_the_weights(report, state_dir) -> None:
    weights = attach(state_dir)  # noqa: F841 (held: the process stays attached while it sleeps)
    t = weights["model.embed_tokens.weight"]
    report("attached")
    t.view(-1)[0] = 12345.0
    t.add_(1.0)
    report("wrote")


def test_a_write_through_an_attached_tensor_cannot_change_the_weights(daemons):
    d = daemons("none")
    with attach(d.state_dir) as weights:
        before, fingerprint = digests(weights), weights.fingerprint
    pid, pipe = fork(write_into_the_weights, d.state_dir)
    try:
        assert read_line(pipe) == "attached"
        assert read_line(pipe) == "", "a write into the daemon's weights went through"
    finally:
        status = end(pid)
        os.close(pipe)
    # killed by the read-only mapping (SIGSEGV) or stopped by an exception
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV or os.WEXITSTATUS(status) != 0
    assert d.get("/health").status_code == 200
    with attach(d.state_dir) as weights:
        assert weights.fingerprint == fingerprint
        assert digests(weights) == before


def test_the_arena_is_sealed_against_writes_and_resizing(daemons):
    """What stops a writer is the memfd itself, not only how attach maps it: even a
    process holding the arena's fd cannot write it, map it writable or resize it."""
    d = daemons("none")
    with DaemonClient(d.state_dir) as client:
        handle, fds = client.arena_fds()
    try:
        assert handle.transport == "memfd" and len(fds) == 1
        fd, size = fds[0], handle.size
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & MEMFD_SEALS == MEMFD_SEALS
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"\0", 0)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size // 2)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, size * 2)
    finally:
        for fd in fds:
            os.close(fd)


def attach_and_wait(report, state_dir) -> None:
    weights = attach(state_dir)  # noqa: F841 (held: the process stays attached while it sleeps)
    report("attached")
    time.sleep(600)


def test_a_killed_worker_leaves_the_daemon_healthy_and_is_forgotten(daemons):
    d = daemons("none")
    fingerprint = d.status()["fingerprint"]
    errors = d.metrics()["preload_errors_total"]
    pid, pipe = fork(attach_and_wait, d.state_dir)
    try:
        assert read_line(pipe) == "attached"
        assert pid in d.status()["attached_workers"]
        os.kill(pid, signal.SIGKILL)
    finally:
        end(pid)
        os.close(pipe)
    assert d.get("/health").status_code == 200
    assert wait_for(lambda: pid not in d.status()["attached_workers"], timeout=10)
    assert d.metrics()["preload_errors_total"] == errors
    with attach(d.state_dir) as weights:  # and it keeps serving new workers
        assert weights.fingerprint == fingerprint


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in (23, 7, 40)]


def close(a: list[float], b: list[float], atol: float = 1e-5) -> bool:
    return len(a) == len(b) and max((abs(x - y) for x, y in zip(a, b)), default=0.0) <= atol


@pytest.mark.parametrize("quant", QUANTS)
def test_attached_llm_equals_in_process_llm(quant, daemons, tiny_checkpoint):
    d = daemons(quant)
    local = LLM(tiny_checkpoint, quant=quant, dtype="float32")
    attached = LLM(tiny_checkpoint, quant=quant, dtype="float32", state_dir=d.state_dir)
    try:
        assert attached.attached is not None and attached.quant == quant
        assert os.getpid() in d.status()["attached_workers"]
        ours = attached.generate(prompts(), max_tokens=12, prompt_logprobs=True, logprobs=True)
        theirs = local.generate(prompts(), max_tokens=12, prompt_logprobs=True, logprobs=True)
        for a, b in zip(ours, theirs):
            assert a.token_ids == b.token_ids
            # Same bytes, same code; only the weights' addresses differ (arena views vs
            # the safetensors mmap), and BLAS may sum in another order for another
            # alignment: equal up to float32 rounding.
            assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
            assert close(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
            assert close(a.logprobs, b.logprobs)
    finally:
        attached.close()
    assert os.getpid() not in d.status()["attached_workers"]


def test_llm_attaches_by_state_dir_alone(daemons):
    d = daemons("fp8_block")
    llm = LLM(state_dir=d.state_dir)
    try:
        assert (llm.quant, llm.dtype) == ("fp8_block", torch.float32)
        assert len(llm.generate([[3, 4, 5]], max_tokens=4)[0].token_ids) >= 1
    finally:
        llm.close()


def test_fingerprint_covers_the_quant_mode(daemons):
    fingerprints = {q: daemons(q).status()["fingerprint"] for q in QUANTS}
    assert len(set(fingerprints.values())) == len(QUANTS), fingerprints


@pytest.mark.parametrize("quant", QUANTS)
def test_each_quant_mode_stores_what_it_says(quant, daemons):
    """Projections become e4m3 with float32 scales (one per matrix, or one per 128x128
    block); embeddings, norms, router and output head stay in high precision."""
    with attach(daemons(quant).state_dir) as weights:
        down = weights["model.layers.0.mlp.down_proj.weight"]  # (64, 288)
        if quant == "none":
            assert down.dtype == torch.float32
            assert not [n for n in weights if n.endswith("_scale_inv")]
        else:
            assert down.dtype == torch.float8_e4m3fn
            scale = weights["model.layers.0.mlp.down_proj.weight_scale_inv"]
            assert scale.dtype == torch.float32
            assert tuple(scale.shape) == ((1, 1) if quant == "fp8_per_tensor" else (1, 3))
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                     "model.layers.1.mlp.gate.weight", "model.layers.1.input_layernorm.weight"):
            assert weights[name].dtype == torch.float32, name
