"""A worker's kernels, recorded on the GPU and compiled into an empty cache by `preload
kernels compile` without a GPU, are every kernel a fresh start then needs: its JIT
compiles nothing, and no launcher is built (kernels/ahead.py, kernels/host_code.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from preload.kernels import ahead

pytestmark = pytest.mark.gpu

GENERATE = """
import json
from preload import BUNDLED_MODEL, LLM
llm = LLM(BUNDLED_MODEL, device="cuda")
out = llm.generate([[5, 6, 7, 8], list(range(2, 40)), list(range(3, 300))], max_tokens=12)
print(json.dumps([c.token_ids for c in out]))
"""


def run(code: str, cache: Path, **env) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(cache)} | env
    r = subprocess.run([sys.executable, *code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def kernels_in(cache: Path) -> set[str]:
    """The cache's compiled kernels (a dir with a cubin each; launchers and the driver's
    helpers are apart)."""
    return {p.parent.name for p in cache.glob("*/*.cubin")}


def host_code_in(cache: Path) -> set[str]:
    """The C host code Triton built into the cache: its driver's helpers, and a launcher
    per kernel signature on a Triton that compiles them (kernels/host_code.py)."""
    return {p.parent.name for p in cache.glob("*/*.so")}


def test_kernels_compiled_ahead_without_a_gpu_are_all_a_fresh_start_compiles(tmp_path):
    first = run(["-c", GENERATE], tmp_path / "recorded")
    listed = ahead.read_list(ahead.list_path(tmp_path / "recorded"))
    assert len(listed) >= 10 and len(kernels_in(tmp_path / "recorded")) >= len(listed) // 2

    fresh = tmp_path / "fresh"
    done = run(["-m", "preload.cli.main", "kernels", "compile", str(ahead.list_path(tmp_path / "recorded"))],
               fresh, CUDA_VISIBLE_DEVICES="")
    assert f"compiled {len(listed)} of {len(listed)}" in done.stdout, done.stdout + done.stderr
    ahead_of_time, built = kernels_in(fresh), host_code_in(fresh)
    assert ahead_of_time == kernels_in(tmp_path / "recorded")
    assert built == host_code_in(tmp_path / "recorded") and built, sorted(built ^ host_code_in(tmp_path / "recorded"))

    again = run(["-c", GENERATE], fresh)
    assert json.loads(again.stdout) == json.loads(first.stdout)
    assert kernels_in(fresh) == ahead_of_time  # (the JIT found every one: none compiled again)
    assert host_code_in(fresh) == built  # (nor any launcher built again: a C compiler run each, 0.1-1 s)
    assert ahead.read_list(ahead.list_path(fresh)) == listed


def test_a_daemon_whose_cache_holds_only_the_list_compiles_it_beside_the_load(tmp_path, monkeypatch):
    """A cache with the list and no kernels (an upgrade emptied it, or the list was copied
    in): the zygote compiles them in forked processes before the first worker starts."""
    import shutil

    from daemons import free_port, running_daemon

    run(["-c", GENERATE], tmp_path / "recorded")
    cache = tmp_path / "listed"
    cache.mkdir(mode=0o700)
    shutil.copy(ahead.list_path(tmp_path / "recorded"), ahead.list_path(cache))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with running_daemon(tmp_path / "state", None, "--device", "cuda:0", "--workers", "1", "--spare-workers", "0",
                        port=free_port()):
        assert kernels_in(cache) >= kernels_in(tmp_path / "recorded")
    said = "".join(p.read_text() for p in (tmp_path / "state").glob("*.log"))
    assert "kernels compiled ahead in" in said and "not all" not in said, said[-3000:]
    assert list(cache.glob("preload-compiled-*"))


PROMPTS_OF = """
import sys
from preload import BUNDLED_MODEL, LLM
llm = LLM(BUNDLED_MODEL, device="cuda")
for i, n in enumerate(map(int, sys.argv[1:])):  # (no two share a first token: no prefix of one is cached for the next)
    llm.generate([[2 + (101 * i + j) % 1500 for j in range(n)]], max_tokens=4)
"""


def test_a_prompt_of_a_new_length_compiles_nothing_a_first_one_did_not(tmp_path):
    """Prompts of 40-64 tokens all replay the same bucket of prompt graphs; only attention
    runs eagerly, over the prompt's own length. A kernel specialized on such a length
    (Triton compiles a variant per integer argument's divisibility by 16) would compile
    again while serving, mid-step (on an H100 a fresh host's first prompt steps of workload
    B took 158 ms, 33 once its cache was full: such compiles, likely). One process serves a
    48-token prompt; another, on the same cache, prompts of 47, 63 and 40 tokens (with or
    without a BOS token, both alignments among them): nothing new is compiled."""
    cache = tmp_path / "cache"
    run(["-c", PROMPTS_OF, "48"], cache)
    seen = kernels_in(cache)
    run(["-c", PROMPTS_OF, "47", "63", "40"], cache)
    new = kernels_in(cache) - seen
    assert not new, sorted(p.name for p in cache.glob("*/*.cubin") if p.parent.name in new)


MIXED_STEPS = """
import sys
from preload import BUNDLED_MODEL, LLM
from preload.options import EngineOptions
llm = LLM(BUNDLED_MODEL, device="cuda", engine=EngineOptions(max_num_seqs=32, max_num_batched_tokens=64))
while llm.engine.capture_idle():  # what an idle worker does before its first request
    pass
if sys.argv[1:] == ["serve"]:  # prompts chunked 64 tokens a step beside 1 to 23 running sequences' decode rows
    prompts = [[2 + (37 * i + j) % 1500 for j in range(20 + 29 * i)] for i in range(24)]
    llm.generate(prompts, max_tokens=24, ignore_eos=True)
"""


def test_steps_that_mix_prompts_and_decode_rows_compile_nothing_an_idle_engine_did_not(tmp_path):
    """Such steps attend eagerly, and their kernels' variants follow how many decode rows
    there are and how long their contexts (on an H100, 22 such variants were compiled
    during a fresh host's first run of workload B, its prompt steps 204 ms against 36). An
    idle engine launches every variant first (attention_warmup.py): one process only
    warms up; another, on the same cache, then serves prompts chunked beside 1 to 23
    decode rows with contexts of 20 to 700 tokens: nothing new is compiled."""
    cache = tmp_path / "cache"
    run(["-c", MIXED_STEPS], cache)
    seen = kernels_in(cache)
    run(["-c", MIXED_STEPS, "serve"], cache)
    new = kernels_in(cache) - seen
    assert not new, sorted(p.name for p in cache.glob("*/*.cubin") if p.parent.name in new)
