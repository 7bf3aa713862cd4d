"""The product on a GPU: VMM arenas mapped read-only, workers on CUDA, every quant mode.

Run on the GPU machine with `python3 -m pytest -m gpu -q`; skipped where CUDA is absent.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from preload import BUNDLED_MODEL, LLM
from preload.ipc.arena import create_arena, map_arena
from preload.ipc.layout import pack

pytestmark = pytest.mark.gpu


def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(2, 97, (n,), generator=gen).tolist() for n in (9, 31, 17)]


def run_preload(*args):
    return subprocess.run([sys.executable, "-m", "preload.cli.main", *args], capture_output=True, text=True)


@pytest.fixture
def daemon(tmp_path, model_dir):
    """Start a daemon on cuda:0 with the given quant and transport; stop it afterwards."""
    started = []

    def start(quant="none", transport="cuda-vmm"):
        state = tmp_path / f"state-{quant}-{transport}"
        port = 18500 + len(started)
        r = run_preload("start", "--model", str(model_dir), "--device", "cuda:0", "--quant", quant,
                        "--transport", transport, "--state-dir", str(state), "--health-port", str(port), "--workers", "0")
        assert r.returncode == 0, r.stderr
        started.append(state)
        return state

    yield start
    for state in started:
        run_preload("stop", "--state-dir", str(state))


def test_vmm_arena_is_shared_read_only(tmp_path):
    entries, size = pack([("w", "float32", (1024,))])
    arena = create_arena("cuda-vmm", size, "cuda:0")
    data = torch.arange(1024, dtype=torch.float32, device="cuda:0")
    arena.write(entries[0], data)
    arena.seal()
    # A second process imports the fd read-only and sees the data; its write faults in it alone.
    script = textwrap.dedent(f"""
        import os, sys, torch
        from preload.ipc.arena import map_arena
        from preload.ipc.layout import TensorEntry
        from preload.ipc.views import tensor_views
        from preload.ipc.manifest import ArenaInfo
        m = map_arena(ArenaInfo.from_wire({arena.info().to_wire()!r}), [int(sys.argv[1])])
        w = tensor_views(m.base, [TensorEntry("w", "float32", (1024,), 0, 4096)])["w"]
        assert torch.equal(w.cpu(), torch.arange(1024, dtype=torch.float32)), "data differs"
        print("read ok", flush=True)
        w.add_(1)
        torch.cuda.synchronize()
        print("write went through", flush=True)
    """)
    fd = os.dup(arena.fd)
    child = subprocess.run([sys.executable, "-c", script, str(fd)], pass_fds=(fd,), capture_output=True, text=True)
    os.close(fd)
    assert "read ok" in child.stdout, child.stderr
    assert "write went through" not in child.stdout and child.returncode != 0
    mine = map_arena(arena.info(), [os.dup(arena.fd)])
    assert torch.equal(mine.base[:4096].view(torch.float32).cpu(), torch.arange(1024, dtype=torch.float32))
    mine.close()
    arena.close()


@pytest.mark.parametrize("quant", ["none", "fp8_per_tensor", "fp8_block"])
def test_attached_equals_in_process_on_cuda(daemon, model_dir, quant):
    state = daemon(quant)
    attached = LLM(model_dir, state_dir=state, device="cuda:0")
    local = LLM(model_dir, quant=quant, device="cuda:0")
    a = attached.generate(prompts(), max_tokens=12, prompt_logprobs=True)
    b = local.generate(prompts(), max_tokens=12, prompt_logprobs=True)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.prompt_logprobs == y.prompt_logprobs
    attached.close()


@pytest.mark.parametrize("quant", ["none", "fp8_per_tensor", "fp8_block"])
def test_cuda_logprobs_close_to_cpu_float32(quant):
    # The trained bundled model (random weights amplify rounding without meaning): bf16
    # activations keep ~3 significant digits, e4m3 weights ~2; the bound is on the mean
    # absolute log-prob difference over held-out text, and on the perplexity.
    text = (Path(__file__).parents[1] / "data" / "heldout.txt").read_text()[:6000]
    cpu = LLM(BUNDLED_MODEL, device="cpu", dtype="float32")
    ids = [cpu.tokenizer.encode(text)[:512]]
    ref = torch.tensor(cpu.generate(ids, max_tokens=1, prompt_logprobs=True)[0].prompt_logprobs[1:])
    gpu = LLM(BUNDLED_MODEL, quant=quant, device="cuda:0")
    got = torch.tensor(gpu.generate(ids, max_tokens=1, prompt_logprobs=True)[0].prompt_logprobs[1:])
    diff = (got - ref).abs()
    ppl_ratio = float((ref.mean() - got.mean()).exp())
    print(f"{quant}: mean |dlogp| {diff.mean():.4f}, max {diff.max():.4f}, perplexity ratio {ppl_ratio:.4f}")
    assert diff.mean() < (0.02 if quant == "none" else 0.08)
    assert ppl_ratio < (1.01 if quant == "none" else 1.05)


def test_cuda_ipc_and_vmm_give_identical_outputs(daemon, model_dir):
    outs = []
    for transport in ("cuda-vmm", "cuda-ipc"):  # one daemon per GPU: the first stops before the second starts
        state = daemon("none", transport)
        llm = LLM(model_dir, state_dir=state, device="cuda:0")
        outs.append([(r.token_ids, r.prompt_logprobs) for r in llm.generate(prompts(), max_tokens=12, prompt_logprobs=True)])
        llm.close()
        run_preload("stop", "--state-dir", str(state))
    assert outs[0] == outs[1]


def test_a_copy_into_device_memory_stores_what_the_computing_loader_stores(model_dir, monkeypatch):
    """The load without torch (copies into the VMM arena from every loader thread; the
    router widened to float32 on the host; fp8_block quantized by our kernel), with 4 KiB
    chunks and with whole tensors: the same bytes and manifest as the loader that computes
    on the GPU with torch."""
    from preload.checkpoint import identity
    from preload.preloadd.copy_loader import load_copied
    from preload.preloadd.loader import load
    from preload.preloadd.weights import Progress

    def stored(loaded) -> tuple[bytes, dict]:
        mapped = map_arena(loaded.arena.info(), [os.dup(loaded.arena.fds()[0])])
        data = mapped.base.cpu().numpy().tobytes()
        mapped.close()
        loaded.arena.close()
        return data, loaded.manifest.to_wire()

    for quant in ("none", "fp8_block"):  # (fp8_block: quantized on the GPU by ipc/fp8_device.py's kernel)
        computed = stored(load(model_dir, quant, torch.bfloat16, torch.device("cuda:0"), "cuda-vmm", Progress()))
        for chunk in (1 << 40, 4096):
            monkeypatch.setattr(identity, "CHUNK_BYTES", chunk)
            progress = Progress()
            copied = load_copied(model_dir, quant, "bfloat16", "cuda:0", "cuda-vmm", progress)
            assert copied is not None and progress.stages["upload"] > 0
            assert (progress.stages.get("quantize", 0) > 0) == (quant == "fp8_block")
            assert stored(copied) == computed, (quant, chunk)


def test_the_daemon_knows_a_gpu_by_the_uuid_torch_gives_it():
    """The per-GPU lock's name, found through the driver (the daemon imports no torch to re-adopt)."""
    from preload.ipc.devices import gpu_uuid

    assert gpu_uuid("cuda:0") == gpu_uuid("cuda") == str(torch.cuda.get_device_properties(0).uuid)


def test_second_daemon_on_the_same_gpu_is_refused(daemon, tmp_path, model_dir):
    daemon()
    r = run_preload("start", "--model", str(model_dir), "--device", "cuda:0", "--state-dir", str(tmp_path / "other"),
                    "--health-port", "18598", "--workers", "0")
    assert r.returncode != 0 and "another preload daemon" in r.stderr


def test_device_memory_returns_after_stop(tmp_path, model_dir):
    def used() -> int:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True)
        return int(out.stdout.strip().splitlines()[0])

    before = used()
    state = tmp_path / "mem"
    r = run_preload("start", "--model", str(model_dir), "--device", "cuda:0", "--state-dir", str(state), "--health-port", "18599",
                    "--workers", "0")
    assert r.returncode == 0, r.stderr
    assert used() > before
    run_preload("stop", "--state-dir", str(state))
    import time

    deadline = time.monotonic() + 10
    while used() > before + 64 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert used() <= before + 64, f"{used() - before} MiB still used after stop"


def test_bundled_model_served_on_cuda_survives_a_rogue_writer(tmp_path):
    """Daemon + worker on the GPU over HTTP; a process that writes into the attached
    weights dies alone; the worker keeps serving the same answer and fingerprint."""
    import json
    import signal
    import time
    import urllib.request

    state, port = tmp_path / "e2e", 18590
    r = run_preload("start", "--device", "cuda:0", "--state-dir", str(state), "--health-port", "18591",
                    "--workers", "1", "--port", str(port))
    assert r.returncode == 0, r.stderr
    try:
        def complete() -> dict:
            body = json.dumps({"prompt": "def main():\n", "max_tokens": 24, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read())

        def status() -> dict:
            return json.loads(run_preload("status", "--state-dir", str(state), "--json").stdout)

        first, before = complete(), status()
        rogue = textwrap.dedent(f"""
            import torch
            from preload import attach
            w = attach({str(state)!r})
            w["model.embed_tokens.weight"].add_(1)
            torch.cuda.synchronize()
            print("write went through", flush=True)
        """)
        child = subprocess.run([sys.executable, "-c", rogue], capture_output=True, text=True)
        assert child.returncode != 0 and "write went through" not in child.stdout
        assert complete()["choices"][0]["text"] == first["choices"][0]["text"]
        assert status()["fingerprint"] == before["fingerprint"]

        # A killed worker is replaced and answers the same.
        os.kill(before["workers"][0]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            w = status()["workers"][0]
            if w["pid"] != before["workers"][0]["pid"] and w["state"] == "ready":
                break
            time.sleep(0.05)
        assert complete()["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        run_preload("stop", "--state-dir", str(state))


def test_workers_share_the_gpu_and_a_warm_spare_takes_over(tmp_path):
    """Two workers and a spare on one GPU with --kv-cache-memory auto: the weights count
    once, each worker gets the same share of what `--gpu-memory-utilization` leaves, the
    whole tree stays within it; a killed worker's slot goes to the warm spare, which
    takes the same share; after stop the device memory is back where it was."""
    import json
    import signal
    import time
    import urllib.request

    from preload.checkpoint.config import ModelConfig
    from preload.options import EngineOptions
    from preload.worker.model.kv_cache import DAEMON_CONTEXT_BYTES, worker_reserve

    def used_mib() -> int:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True)
        return int(out.stdout.strip().splitlines()[0])

    def status() -> dict:
        return json.loads(run_preload("status", "--state-dir", str(state), "--json").stdout)

    def complete() -> str:
        body = json.dumps({"prompt": "def main():\n", "max_tokens": 16, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())["choices"][0]["text"]

    def wait(predicate, timeout=60.0):
        deadline = time.monotonic() + timeout
        while not (value := predicate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return value

    utilization, max_seqs = 0.2, 100_000  # so many sequences that the share, not their length, bounds the cache
    state, port = tmp_path / "share", 18592
    total = torch.cuda.mem_get_info(0)[1]  # (this process's own context made before, not counted as the tree's)
    before = used_mib()
    r = run_preload("start", "--device", "cuda:0", "--state-dir", str(state), "--health-port", "18593", "--workers", "2",
                    "--spare-workers", "1", "--port", str(port), "--gpu-memory-utilization", str(utilization),
                    "--max-num-seqs", str(max_seqs))
    assert r.returncode == 0, r.stderr
    try:
        spare = wait(lambda: [x for x in status()["spares"] if x["state"] == "standby"])
        assert spare, status()
        s = status()
        weights = s["bytes_per_device"]["cuda:0"]
        reserve = worker_reserve(ModelConfig.from_dir(Path(BUNDLED_MODEL)), EngineOptions().max_num_batched_tokens)
        expected = (utilization * total - weights - DAEMON_CONTEXT_BYTES - 3 * reserve) / 2
        kv = [w["kv_cache_bytes"] for w in s["workers"]]
        assert kv[0] == kv[1] and abs(kv[0] - expected) < 0.01 * expected, (kv, expected)
        in_use = (used_mib() - before) << 20
        per_process = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                                     capture_output=True, text=True).stdout
        assert in_use <= utilization * total, (f"{in_use / 2**30:.2f} GiB in use > {utilization} of the device; KV"
                                               f" {kv}, reserve {reserve}, weights {weights}; daemon {s['pid']}, workers"
                                               f" {[w['pid'] for w in s['workers']]}, spares {[x['pid'] for x in s['spares']]};"
                                               f" by process:\n{per_process}")
        first = complete()

        old = s["workers"][0]["pid"]
        os.kill(old, signal.SIGKILL)
        w = wait(lambda: (x := status()["workers"][0])["pid"] != old and x["state"] == "ready" and x)
        assert w and w["pid"] == spare[0]["pid"] and w["kv_cache_bytes"] == kv[0], w
        assert complete() == first
    finally:
        run_preload("stop", "--state-dir", str(state))
    assert wait(lambda: used_mib() <= before + 64, timeout=15), f"{used_mib() - before} MiB still used after stop"
