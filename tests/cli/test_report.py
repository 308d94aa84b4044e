"""`kvcache report`: numbers checked against hand-computed values and against what a real store
answered; the HTML embeds every plot; an empty log and odd data give a report, not a traceback."""

import argparse
import datetime as dt
import json
import math
import re

import pyarrow as pa
import pytest

from kvcache.cli.report import add_parser, cmd_report, compute_report, parse_since, resolve_events_dir
from kvcache.cli.report_html import render_html
from kvcache.kvstore.event_log import ParquetEventLog, read_events
from kvcache.kvstore.events import Event
from tests.kvstore.event_sim import simulate

T = 1_699_999_800.0  # a multiple of 300 s, so the 5-minute timeline buckets start at T
IMG = '<img alt='
PNG = 'src="data:image/png;base64,'


def _args(path, **kw):
    return argparse.Namespace(data_dir=str(path), since=kw.get("since"), out=kw.get("out"), json=kw.get("json", True))


def _report(path, capsys, **kw) -> dict:
    assert cmd_report(_args(path, **kw)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def hand_log(tmp_path):
    """A small log whose every number is worked out in the comments (16- and 32-token blocks)."""
    events = [
        Event(T, "lookup", "aa", "acme", 100, 1600, 60, hits_dram=40, hits_nvme=20),
        Event(T + 100, "lookup", "", "acme", 10, 0, 0),          # full miss: acme's block size, 16 -> 160
        Event(T + 3600, "lookup", "bb", "beta", 300, 9600, 300, hits_nvme=200, hits_object=100),
        Event(T + 7200, "lookup", "", "beta", 5, 0, 0),           # beta's block size, 32 -> 160
        Event(T + 7200, "lookup", "aa", "", 4096, 65536, 1024, hits_dram=1024),
        Event(T + 7250, "lookup", "", "gamma", 2, 0, 0),          # no block size of its own: most frequent, 16
        Event(T + 10, "get", "aa", "acme", 60, 960, 60, hits_dram=40, hits_nvme=20, nbytes=6000),
        Event(T + 20, "put", "aa", "acme", 40, 640, nbytes=4000),
        Event(T + 30, "evict", tier="dram", blocks=50, nbytes=5000, mean_age_s=1800),
        Event(T + 40, "expire", tier="nvme", blocks=7, mean_age_s=2 * 86400),
        Event(T + 50, "expire", tier="nvme", blocks=3, mean_age_s=5 * 86400),
    ]
    with ParquetEventLog(str(tmp_path / "events"), tick_s=3600) as log:
        for e in events:
            log.record(e)
    return tmp_path


def test_hand_computed_numbers(hand_log, capsys):
    rep = _report(hand_log, capsys)
    requested = 1600 + 160 + 9600 + 160 + 65536 + 32
    hit = 960 + 9600 + 16384
    assert rep["unit"] == "tokens" and rep["events"] == 11 and rep["files"] == 1
    assert rep["lookups"] == {"count": 6, "requested": requested, "hit": hit,
                              "hit_rate": pytest.approx(hit / requested), "inferred_block_size": 3}
    assert rep["prefill_tokens_saved"] == 960          # what the one get served, not what lookups found
    tiers = rep["tiers"]
    assert [tiers[t]["hit_tokens"] for t in ("dram", "nvme", "object")] == [640 + 16384, 320 + 6400, 3200]
    assert tiers["dram"]["share"] == pytest.approx(17024 / hit)
    assert [tiers[t]["bytes_served"] for t in ("dram", "nvme", "object")] == [4000, 2000, 0]
    assert tiers["dram"]["bytes_evicted"] == 5000
    tenants = {r["tenant"]: (r["lookups"], r["requested"], r["hit"]) for r in rep["tenants"]}
    assert tenants == {"": (1, 65536, 16384), "beta": (2, 9760, 9600), "acme": (2, 1760, 960), "gamma": (1, 32, 0)}
    assert [r["tenant"] for r in rep["tenants"]] == ["", "beta", "acme", "gamma"]  # most tokens first
    buckets = {b["bucket"]: (b["lookups"], b["requested"], b["hit"], b["hit_rate"]) for b in rep["prefix_buckets"]}
    assert buckets == {"<1k": (3, 352, 0, 0.0), "1-4k": (1, 1600, 960, 0.6), "4-16k": (1, 9600, 9600, 1.0),
                       "16-64k": (0, 0, 0, None), ">=64k": (1, 65536, 16384, 0.25)}
    assert rep["removals"]["evict"]["by_age"] == {"<1h": 50, "1-6h": 0, "6-24h": 0, "1-3d": 0, ">=3d": 0}
    assert rep["removals"]["expire"]["by_age"] == {"<1h": 0, "1-6h": 0, "6-24h": 0, "1-3d": 7, ">=3d": 3}
    assert rep["gets"] == {"count": 1, "blocks": 60, "hit_blocks": 60, "bytes": 6000}
    assert rep["puts"]["bytes"] == 4000
    assert rep["timeline_step_s"] == 300
    assert [(p["start"], p["requested"], p["hit"]) for p in rep["timeline"]] == [
        (T, 1760, 960), (T + 3600, 9600, 9600), (T + 7200, 160 + 65536 + 32, 16384)]


def test_since_and_html(hand_log, tmp_path, capsys):
    since = dt.datetime.fromtimestamp(T + 3600, dt.timezone.utc).isoformat()
    out = tmp_path / "report.html"
    rep = _report(hand_log, capsys, since=since, out=str(out))
    assert rep["lookups"]["count"] == 4 and rep["lookups"]["requested"] == 9600 + 160 + 65536 + 32
    page = out.read_text()
    assert page.count(PNG) == 5 == page.count(IMG)
    for title in ("Hit rate over time", "Hit tokens per tier", "Per tenant", "Per prompt length",
                  "Evictions and expirations by age"):
        assert f"<h2>{title}</h2><img alt='{title}' {PNG}" in page
    for b64 in re.findall(r'base64,([A-Za-z0-9+/=]+)"', page):
        assert len(b64) > 1000


def test_terminal_summary(hand_log, capsys):
    assert cmd_report(_args(hand_log, json=False)) == 0
    out = capsys.readouterr().out
    assert "token hit rate" in out and f"{26944 / 77088:.1%}" in out
    assert "prefill tokens saved  960" in out
    assert re.search(r"beta\s+2\s+9,760\s+9,600\s+98.4%", out)
    assert re.search(r"1-3d\s+0\s+7", out)


def test_report_matches_what_a_real_store_answered(tmp_path, clock, capsys):
    tally = simulate(str(tmp_path), clock, hours=48, rotate_s=3600)
    rep = _report(tmp_path, capsys)  # the data directory: its events/ folder is found
    bs = 16
    req, hit = sum(tally.requested.values()), sum(tally.hits.values())
    assert rep["files"] == 48 and rep["lookups"]["count"] == 96
    assert (rep["lookups"]["requested"], rep["lookups"]["hit"]) == (req * bs, hit * bs)
    assert rep["lookups"]["hit_rate"] == pytest.approx(hit / req)
    for row in rep["tenants"]:
        assert row["hit_rate"] == pytest.approx(tally.hits[row["tenant"]] / tally.requested[row["tenant"]])
    assert rep["tiers"]["nvme"]["hit_tokens"] == tally.hit_tiers["nvme"] * bs
    assert {b["bucket"]: b["lookups"] for b in rep["prefix_buckets"]}["4-16k"] == 48  # beta: 300 x 16 tokens
    assert sum(rep["removals"]["expire"]["by_age"].values()) == tally.expired
    assert sum(rep["removals"]["evict"]["by_age"].values()) == tally.evicted
    assert rep["timeline_step_s"] == 3600 and len(rep["timeline"]) == 48


def test_empty_log_says_so(tmp_path, capsys):
    (tmp_path / "events").mkdir()
    out = tmp_path / "r.html"
    rep = _report(tmp_path, capsys, out=str(out))
    assert rep["events"] == 0 and rep["files"] == 0
    assert "no events recorded" in out.read_text()
    assert cmd_report(_args(tmp_path, json=False, since="2h")) == 0
    assert "no events recorded since" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError):
        cmd_report(_args(tmp_path / "nope"))


def test_odd_data_never_crashes(tmp_path, capsys):
    nan, inf = math.nan, math.inf
    with ParquetEventLog(str(tmp_path), tick_s=3600) as log:
        for e in [Event(nan, "lookup", blocks=5, tokens=80),                        # no time: dropped
                  Event(T, "lookup", "aa", "<script>$x", 4, 64, 9, hits_dram=9),  # hits above request
                  Event(T, "lookup", "aa", "neg", -3, -48, -1, latency_s=nan),
                  Event(T, "weird-kind", blocks=10**12),
                  Event(T, "evict", blocks=2, mean_age_s=nan),
                  Event(inf, "get", blocks=1)]:
            log.record(e)
    rep = _report(tmp_path, capsys, out=str(tmp_path / "r.html"))
    assert rep["events"] == 4 and rep["lookups"]["hit"] == 64 and rep["lookups"]["hit_rate"] == 1.0
    assert rep["removals"]["evict"]["by_age"]["<1h"] == 2
    page = (tmp_path / "r.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;$x" in page and page.count(PNG) == 5


def test_nulls_and_no_block_size_anywhere():
    table = pa.table({"time": [T, T + 1, None], "kind": ["lookup", None, "lookup"], "namespace": ["", "", ""],
                      "tenant": [None, "a", "b"], "blocks": [4, 1, 2], "tokens": [0, 0, None],
                      "hit_blocks": [0, 0, 0], "hits_dram": [0, 0, 0], "hits_nvme": [0, 0, 0],
                      "hits_object": [0, 0, 0], "tier": ["", "", ""], "nbytes": [0, 0, 0],
                      "latency_s": [0.0, 0.0, 0.0], "mean_age_s": [0.0, 0.0, 0.0]})
    rep = compute_report(table)
    assert rep["unit"] == "blocks" and rep["lookups"]["requested"] == 4 and rep["lookups"]["hit_rate"] == 0.0
    assert "block hit rate" in render_html(rep) and render_html(rep).count(PNG) == 5


def test_parse_since():
    now = 1_000_000.0
    assert parse_since("24h", now) == now - 86400
    assert parse_since("30m", now) == now - 1800
    assert parse_since(" 1.5H ", now) == now - 5400
    assert parse_since("2w", now) == now - 14 * 86400
    at8 = dt.datetime(2026, 11, 30, 8, tzinfo=dt.timezone.utc).timestamp()
    assert parse_since("2026-11-30T08:00Z", now) == at8
    assert parse_since("2026-11-30T08:00", now) == at8  # naive means UTC
    assert parse_since("2026-11-30T10:00+02:00", now) == at8
    assert parse_since("2026-11-30", now) == at8 - 8 * 3600
    for bad in ("yesterday", "-5h", "24x", ""):
        with pytest.raises(ValueError, match="--since"):
            parse_since(bad, now)


def test_parser_registration_and_dir_resolution(tmp_path):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", str(tmp_path), "--since", "24h", "--out", "r.html", "--json"])
    assert args.func is cmd_report and (args.since, args.out, args.json) == ("24h", "r.html", True)
    assert parser.parse_args(["report"]).data_dir is None
    assert resolve_events_dir(str(tmp_path)) == str(tmp_path)
    (tmp_path / "events").mkdir()
    assert resolve_events_dir(str(tmp_path)) == str(tmp_path / "events")
    assert read_events(resolve_events_dir(str(tmp_path))).num_rows == 0


def test_prefill_tokens_saved_is_what_engines_used_read_from_a_running_daemon(tmp_path, capsys):
    """Ten runs through a real daemon, some of whose hits the engine cannot use (a hit no longer
    than the replay window is recomputed whole): lookups find more than the engine used, and the
    report's prefill tokens saved is the engine's cached tokens, read while the daemon runs."""
    import time
    import torch
    from kvcache.engine.config import CacheConfig, EngineConfig
    from kvcache.engine.llm import LLM
    from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from kvcache.engine.sampling import SamplingParams
    from kvcache.client.sync_client import KVClient
    from tests.engine.tiny import randomize, v4_config
    from tests.server.test_serve_process import Daemon
    model = randomize(DeepseekV4ForCausalLM(v4_config(num_nextn_predict_layers=0)), seed=1).eval()
    cfg = EngineConfig(block_size=16, num_blocks=128, max_tokens_per_step=48, max_running=8,
                       cache=CacheConfig(mode="replay", replay_blocks=2))
    g = torch.Generator().manual_seed(5)
    doc = torch.randint(3, 380, (96,), generator=g).tolist()             # 6 blocks

    def tail():
        return torch.randint(3, 380, (7,), generator=g).tolist()
    prompts = [doc + tail()] + [doc[:40] + tail() if i % 2 else doc + tail() for i in range(9)]   # 2-block hits
    d = Daemon(tmp_path / "data")
    try:
        d.wait_ready()
        used = 0
        with KVClient(d.url) as client, LLM(model=model, config=cfg, store=client) as llm, torch.no_grad():
            for p in prompts:
                llm.engine.reset_prefix_cache()                          # only the daemon can serve
                [[out]] = llm.generate([p], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
                used += sum(n for tier, n in out.usage.cached_tokens.items() if tier != "hbm")
        assert used == 5 * 96
        deadline = time.monotonic() + 60
        while True:                                                       # live files: no rotation needed
            rep = _report(tmp_path / "data", capsys)
            if rep["events"] and rep["lookups"]["count"] == 10 and rep["gets"]["count"] >= 5 \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert rep["lookups"]["hit"] == used + 4 * 32 and rep["prefill_tokens_saved"] == used
    finally:
        d.proc.kill()
        d.proc.wait()
