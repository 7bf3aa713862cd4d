"""The benchmarks' pure parts: the quantile rule, each table printed from a small
recorded result (recorded/*.json, from real runs on the 2-core CPU machine; decode's on
the H200, where its profile has something to show), and the
summary math. Nothing here starts a daemon."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from preload.bench import cold, decode, memory, prefix, readopt, restart, serve
from preload.bench.results import quantiles, row

RECORDED = Path(__file__).parent / "recorded"


def recorded(name: str) -> dict:
    return json.loads((RECORDED / f"{name}.json").read_text())


def test_quantiles_interpolate_between_closest_ranks():
    q = quantiles([4.0, 1.0, None, 3.0, 2.0])
    assert q == {"p50": 2.5, "p90": pytest.approx(3.7), "min": 1.0, "max": 4.0, "mean": 2.5, "n": 4}
    assert quantiles([5.0], (50, 99)) == {"p50": 5.0, "p99": 5.0, "min": 5.0, "max": 5.0, "mean": 5.0, "n": 1}
    assert quantiles([]) is None and quantiles([None]) is None


def test_row_aligns_the_first_cell_left_and_the_rest_right():
    assert row(("a", "1", "22"), (3, 4, 4)) == "a       1    22"
    assert row(("a", ""), (3, 4)) == "a"  # no trailing blanks


def test_restart_table_from_a_recorded_run():
    result = recorded("restart")
    table = restart.format_table(result)
    print(table)
    r = result["models"][0]
    for kind in restart.KINDS:
        line = next(ln for ln in table.splitlines() if ln.split()[:1] == [kind])
        assert f"{r['restart'][kind]['seconds']['p50']:.3f}" in line
    assert "spare promoted 1/1" in table
    assert "imports" in table and f"{r['worker_stages']['imports_s']:.3f}" in table
    assert "daemon_imports" in table


def replacement(**stamps) -> dict:
    """A slot's last_replacement as /status publishes it (times: seconds after 1000)."""
    return {"cause": "exit: killed by SIGKILL", "old_pid": 10, "new_pid": 11, "killed": None} | {
        k: v if isinstance(v, str) or v is None else 1000 + v for k, v in stamps.items()}


def test_breakdown_of_a_fork():
    rep = replacement(via="fork", reaped=0.05, forked=0.07, slot_given=0.071, ready=0.37)
    b = restart.breakdown(rep, 1000.0, seconds=0.40)
    assert b == pytest.approx({"old_reaped_s": 0.05, "event_to_forked_s": 0.07, "forked_to_ready_s": 0.30,
                               "go_to_ready_s": 0.299, "ready_to_answer_s": 0.03})


def test_breakdown_of_a_spare_taking_the_slot():
    rep = replacement(via="spare", reaped=0.04, forked=-5.0, slot_given=0.045, ready=0.27)
    b = restart.breakdown(rep, 1000.0, seconds=0.30)
    assert b == pytest.approx({"old_reaped_s": 0.04, "event_to_promoted_s": 0.045, "promoted_to_ready_s": 0.225,
                               "go_to_ready_s": 0.225, "ready_to_answer_s": 0.03})


def test_breakdown_of_a_rolling_restart_says_who_drained_first():
    # Room for both KV caches: the new worker is given the slot, then the old one drains.
    rep = replacement(cause="restart", via="fork", forked=0.02, slot_given=0.3, ready=0.45, old_signalled=0.46,
                      old_reaped=0.7)
    b = restart.breakdown(rep, 1000.0, seconds=0.5)
    assert b["old_reaped_s"] == pytest.approx(0.7) and b["drained_first"] is False
    # No room: the old one drains and exits first.
    rep |= {"old_signalled": 1000.25, "old_reaped": 1000.28}
    assert restart.breakdown(rep, 1000.0, seconds=0.5)["drained_first"] is True
    # Stamps not there (yet): no figure rather than a wrong one.
    assert restart.breakdown(replacement(via="fork", forked=0.1, slot_given=0.1, ready=None), 1000.0, 0.5) == {
        "old_reaped_s": None, "event_to_forked_s": pytest.approx(0.1), "forked_to_ready_s": None,
        "go_to_ready_s": None, "ready_to_answer_s": None}


def test_settled_waits_for_the_new_worker_ready_and_the_old_one_reaped():
    found = restart.settled(10)
    worker = {"slot": 0, "pid": 11, "state": "ready", "kv_cache_bytes": 1,
              "last_replacement": replacement(via="fork", reaped=0.05, forked=0.07, slot_given=0.07, ready=0.3)}
    assert found({"workers": [worker]}) is worker
    assert found({"workers": [worker | {"state": "starting"}]}) is None
    unreaped = copy.deepcopy(worker)
    unreaped["last_replacement"].pop("reaped")
    assert found({"workers": [unreaped]}) is None
    assert found({"workers": [worker | {"pid": 10}]}) is None  # (the old one, still there)
    other = copy.deepcopy(worker)
    other["last_replacement"]["new_pid"] = 12  # (a replacement that is not the one holding the slot)
    assert found({"workers": [other]}) is None


def test_summary_ratios_and_checks():
    recs = [{"kind": "sigkill-spare", "seconds": s, "via": "spare", "promoted": True, "zygote_renewed": False,
             "old_kv_cache_bytes": 1, "new_kv_cache_bytes": 1, "breakdown": {"old_reaped_s": s / 10}}
            for s in (0.3, 0.4, 0.5)]
    cold = {"exit_s": quantiles([4.0]), "api_health_s": quantiles([5.0])}
    s = restart.summarize(recs, cold)
    assert s["seconds"]["p50"] == pytest.approx(0.4)
    assert s["ratio_p50_over_cold_exit"] == pytest.approx(0.1) and s["ratio_p50_over_cold_api_health"] == pytest.approx(0.08)
    assert s["breakdown_median"]["old_reaped_s"] == pytest.approx(0.04) and s["breakdown_median"]["go_to_ready_s"] is None
    assert s["promoted"] == 3 and restart.checks(s, 3) == "spare promoted 3/3"


def test_cold_breakdown_from_status():
    status = {"uptime_s": 3.0, "load_seconds": 0.5, "workers": [{"last_replacement": replacement(
        cause="start", via="fork", forked=1.5, slot_given=1.5, ready=1.8)}]}
    b = restart.cold_breakdown(status, read_at=1003.0, launched=998.0)
    assert b == pytest.approx({"daemon_imports_s": 2.0, "load_s": 0.5, "zygote_start_s": 1.0,
                               "worker_start_to_ready_s": 0.3})


def test_memory_table_from_a_recorded_run_and_a_gpu():
    result = recorded("memory")
    table = memory.format_table(result)
    print(table)
    assert [ln.split()[1] for ln in table.splitlines() if ln.startswith("bundled")] == ["1", "1+1sp", "2"]
    assert "device memory" not in table
    # The device table, with nvidia-smi's figures as they would come on an H200.
    mem = result["models"][0]["memory_2"]
    mem["gpu"] = {"name": "H200", "total_mib": 143771, "used_mib": 40000, "utilization_cap_mib": 129393.9,
                  "within_cap": True, "arena_bytes": mem["arena_bytes"], "daemon_mib": 1100, "unattributed_mib": 30000,
                  "zygote_on_device": False, "spare_mib": [], "other_mib": 0, "per_process": [], "pids_matched": True,
                  "per_worker": [{"pid": w["pid"], "slot": w["slot"], "used_mib": 4450 + w["slot"], "kv_cache_bytes": 4 << 30,
                                  "beyond_kv_mib": 354 + w["slot"]} for w in mem["per_worker"]],
                  "used_before_start_mib": 0, "used_after_stop_mib": 0, "seconds_to_baseline": 0.5,
                  "returned_to_baseline": True, "pids_left_on_device": []}
    line = next(ln for ln in memory.format_table(result).splitlines()[-2:] if ln.startswith("bundled"))
    assert "4450..4451" in line and "30000" in line and "(!)" not in line


def test_spares_standing_by():
    status = {"spares": [{"pid": 1, "state": "standby"}, {"pid": 2, "state": "warming"}]}
    assert memory.standing_by(status, 2) is None
    status["spares"][1]["state"] = "standby"
    assert memory.standing_by(status, 2) is status


def test_cold_table_from_a_recorded_run():
    result = recorded("cold")
    table = cold.format_table(result)
    print(table)
    for quant, s in result["start"].items():
        line = next(ln for ln in table.splitlines() if ln.startswith(quant + " "))
        assert f"{s['start_to_ready_s']['p50']:.3f}" in line
        # against `cat` of the same files, and ready - load against `import torch` (the targets' terms)
        versus = next(ln for ln in table.splitlines() if ln.startswith(quant + " vs cat"))
        assert f"load {cold._ratio(s['ratio_load_over_cat'])}" in versus and f"{result['import_torch']['p50']:.3f} s" in versus
    assert f"`cat` of the files {cold._dur(result['cat_files']['p50'])}" in table


def test_cold_table_with_a_worker_shows_the_first_start_apart():
    """An H200 run of `bench cold --quant fp8_block --workers 1`: the start with no kernels
    compiled (a machine's first) is its own line, each start's log lines under it."""
    result = recorded("cold-workers")
    table = cold.format_table(result)
    first = result["first_start"]["fp8_block"]
    line = next(ln for ln in table.splitlines() if ln.startswith("fp8_block first"))
    assert f"ready {first['start_to_ready_s']:.3f} s = {cold._ratio(first['ratio_ready_over_cat'])} `cat`" in line
    assert all(log_line in table for log_line in first["worker_log"] + result["start"]["fp8_block"]["worker_log"])
    assert any("captured 16 decode graphs" in ln for ln in first["worker_log"])


def test_checkpoint_reading_helpers(tmp_path):
    import torch

    from preload.bench import file_reads
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(4, 4), "b": torch.zeros(100)}, str(tmp_path / "model.safetensors"))
    files = file_reads.checkpoint_files(tmp_path)
    assert file_reads.largest_tensor(files) == ("b", 400)
    seconds, n = file_reads.read_files(files, bytearray(64))
    assert n == files[0].stat().st_size and seconds >= 0
    with pytest.raises(FileNotFoundError):
        file_reads.checkpoint_files(tmp_path / "nothing")


def test_serve_figures_and_table():
    records = [serve.RequestRecord(64, 3, ok=True, ttft=0.1, latency=0.3, output_tokens=3, chunk_gaps=[0.1, 0.1]),
               serve.RequestRecord(64, 3, ok=True, ttft=0.2, latency=0.4, output_tokens=3, chunk_gaps=[0.1, 0.1]),
               serve.RequestRecord(64, 3, error="HTTP 503: draining")]
    f = serve.figures(records, wall=1.0, client_cpu_s=0.9)
    assert (f["completed"], f["failed"], f["errors"]) == (2, 1, ["HTTP 503: draining"])
    assert f["client_cpu_share"] == pytest.approx(0.9)
    busy = "\n".join(serve.run_lines(f))
    assert "the client (this process) was busy 90% of the run: near a whole core" in busy
    assert "near a whole core" not in "\n".join(serve.run_lines(serve.figures(records, wall=1.0, client_cpu_s=0.2)))
    assert f["throughput"]["output_tokens_per_s"] == 6 and f["ttft_s"]["p50"] == pytest.approx(0.15)
    assert f["tpot_s"]["p50"] == pytest.approx(0.1) and f["itl_s"]["n"] == 4
    result = recorded("serve")
    table = serve.format_table(result)
    print(table)
    assert "during 2 `preload restart` round(s)" in table
    assert table.count("time to first token") == 2
    assert serve.parse_range("64:256") == (64, 256) and serve.parse_range("8") == (8, 8)
    with pytest.raises(ValueError):
        serve.parse_range("9:8")


def test_readopt_table_from_a_recorded_run():
    result = recorded("readopt")
    table = readopt.format_table(result)
    print(table)
    cold = next(ln for ln in table.splitlines() if ln.startswith("cold start"))
    assert f"{result['cold']['exit_s']:.3f}" in cold and f"{result['cold']['load_seconds']:.3f}" in cold
    p50 = next(ln for ln in table.splitlines() if ln.startswith("after SIGKILL, p50"))
    assert f"{result['readopt_exit_s']['p50']:.3f}" in p50
    n = len(result["runs"])
    assert f"re-adopted {n}/{n}" in table and f"{result['requests']['failed']} failed" in table


def test_prefix_table_from_a_recorded_run():
    result = recorded("prefix")
    table = prefix.format_table(result)
    print(table)
    on = next(ln for ln in table.splitlines() if ln.split()[:1] == ["on"])
    assert f"{result['runs']['on']['repeated_ttft_s']:.3f} s" in on
    assert f"{100 * result['runs']['on']['chat_hit_rate']:.1f}%" in on
    off = next(ln for ln in table.splitlines() if ln.split()[:1] == ["off"])
    assert off.rstrip().endswith("-")  # nothing is looked up without the cache


def test_restart_table_of_a_run_of_some_kinds_only():
    """(`bench restart --kinds sigkill-spare`: no fork, graceful or no-zygote daemon figures.)"""
    result = recorded("restart")
    for m in result["models"]:
        m.pop("cold_no_zygote")
        m["restart"] = {"sigkill-spare": m["restart"]["sigkill-spare"]}
    table = restart.format_table(result)
    assert "sigkill-spare" in table and "graceful" not in table and "no zygote" not in table


def test_decode_table_from_a_recorded_gpu_run():
    result = recorded("decode")
    table = decode.format_table(result)
    print(table)
    for run in result["runs"]:
        assert f"{run['output_tok_s']:.1f}" in table
    for p in result["profiles"]:
        # the step's wall time, the GPU's share, the graph's launch on the host; the top kernels and host functions
        assert f"{p['wall_ms']:.2f} ms a step" in table and f"{p['launch_us']:.0f} us" in table
        assert p["top"][0]["kernel"] in table and p["host_top"][0]["function"] in table
