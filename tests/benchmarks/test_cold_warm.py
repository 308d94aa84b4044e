"""The cold-versus-warm benchmark end to end on the tiny config: every scenario reads from the
tier it claims, warm output equals cold, and the JSON, Markdown and plot are written."""

import json
import os

from kvcache.benchmarks.cold_warm import run
from kvcache.benchmarks.cold_warm_report import format_table


def test_cold_warm_benchmark_on_the_tiny_config(tmp_path):
    doc = run("v4-tiny", lengths=(512, 1024), out_tokens=3, out_dir=str(tmp_path), progress=False)
    for n in ("512", "1024"):
        r = doc["results"][n]
        assert r["cold"]["prefill_tokens_computed"] == int(n) + 32 and not r["cold"]["cached_tokens"]
        for name, tier in (("warm_pool", "hbm"), ("warm_dram", "dram"), ("warm_nvme", "nvme"),
                           ("restart", "nvme"), ("warm_object", "object")):
            assert r[name]["cached_tokens"] == {tier: int(n)}, (name, r[name]["cached_tokens"])
            assert r[name]["prefill_tokens_computed"] == 32
        assert all(r["exact"].values())
        assert r["footprint"]["nvme_bytes"] > 0 and r["footprint"]["object_bytes"] > 0
    assert doc["warm_matches_cold"] and doc["workloads"]["chat"]["exact"] and doc["workloads"]["shared"]["exact"]
    shared = doc["workloads"]["shared"]
    assert shared["blocks_fetched"] == shared["prefix_blocks"]          # 8 users, one fetch of the prefix
    for key in ("warm_dram_ttft_vs_cold", "warm_nvme_ttft_vs_cold", "warm_object_ttft_vs_cold",
                "worst_warm_ttft_vs_floor"):
        assert doc[key] > 0
    saved = json.load(open(tmp_path / "cold_warm-latest.json"))
    assert saved["results"]["1024"]["warm_dram"]["bytes_loaded"] > 0
    assert os.path.getsize(tmp_path / "cold_warm-latest.png") > 1000
    assert "warm_dram" in (tmp_path / "cold_warm-latest.md").read_text() and "warm_dram" in format_table(doc)


def test_every_timed_run_of_a_cached_engine_has_its_cost_model_on(tmp_path, monkeypatch):
    """The restart's new engine serves one discarded request before it is timed, so that it has a
    prefill speed (the cost model weighs loading against recomputing) like the long-lived one."""
    from kvcache.benchmarks import cold_warm
    timed, measure = [], cold_warm._measure

    def spy(llm, prompt, out_tokens):
        if llm.engine.cache is not None:
            timed.append((tuple(prompt), llm.engine.cache.prefill_s_per_token is not None))
        return measure(llm, prompt, out_tokens)
    monkeypatch.setattr(cold_warm, "_measure", spy)
    run("v4-tiny", lengths=(512,), out_tokens=2, out_dir=str(tmp_path), progress=False, workloads=("document",))
    (prompt, known), *rest = timed                        # the fill run: the first prefill it measures
    warm = [k for p, k in rest if p == prompt]
    assert not known and len(warm) == 3 * 5 and all(warm), warm
    assert len(rest) == len(warm) + 1                     # + the restart's warm-up
