"""Trace replay: the unlimited and LRU baselines by hand on a small trace, the store's replay within
them, and the real Mooncake trace's published facts."""

import io
import json
import os
import subprocess
import sys

import pytest

from kvcache.gc.collector import Collector
from kvcache.kvstore.trace_replay import TraceRequest, load_trace, lru_hit_rate, store_replay, unlimited_hit_rate

TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces",
                     "mooncake_conversation_trace.jsonl")


def req(t, ids, n_tokens=None):
    return TraceRequest(t, n_tokens or 512 * len(ids), tuple(ids))


def test_baselines_by_hand():
    trace = [req(0, [1, 2, 3]), req(1, [1, 2, 9]), req(2, [1, 5]), req(3, [7, 2, 3]), req(4, [1, 2, 3], 1200)]
    u = unlimited_hit_rate(trace)
    # hits: -, [1,2], [1], -, [1,2,3] (last block of 176 tokens)
    assert u["block_hits"] == 2 + 1 + 3 and u["distinct_blocks"] == 6
    total = 512 * 11 + 1200
    assert u["token_hit_rate"] == pytest.approx((1024 + 512 + 1200) / total)
    # an LRU of 3 blocks: after request 3 it holds {7, 2, 3}, so request 4's first block (1) misses
    assert lru_hit_rate(trace, 3) == pytest.approx((1024 + 512) / total)
    assert lru_hit_rate(trace, 100) == pytest.approx(u["token_hit_rate"])


def test_store_replay_stays_within_the_baselines():
    trace = [req(i * 10.0, [0] + [1000 * (i % 30) + j for j in range(1, 6)]) for i in range(90)]
    u = unlimited_hit_rate(trace)["token_hit_rate"]
    big = store_replay(trace, 4096, dram_bytes=8 << 20, nvme_bytes=64 << 20, maintenance=Collector)
    assert big["token_hit_rate"] == pytest.approx(u)                       # everything fits: every prefix hits
    small = store_replay(trace, 4096, dram_bytes=2 << 20, nvme_bytes=96 * 4096, maintenance=Collector)
    assert 0 < small["token_hit_rate"] < u and small["dram_hit_rate"] + small["nvme_hit_rate"] == pytest.approx(
        small["token_hit_rate"])
    assert sum(b["tokens"] for b in small["over_time"]) == sum(sum(r.block_tokens()) for r in trace)


def _conversations(n=500, seed=0):
    """Skewed multi-turn conversations: each request re-reads its conversation's earlier blocks
    and adds one; a shared first block."""
    import random
    rng, turns, out = random.Random(seed), {}, []
    for i in range(n):
        c = min(int(rng.paretovariate(1.0)), 80)
        turns[c] = turns.get(c, 0) + 1
        out.append(req(i * 5.0, [0] + [10_000 * c + j for j in range(1, turns[c] + 2)]))
    return out


@pytest.mark.parametrize("eviction", ["lru", "duel"])
def test_a_restart_mid_replay_keeps_the_hit_rate(eviction):
    """The DRAM tier empties on a restart (its order too); NVMe and its eviction order (the
    index's access times) carry on, so the hit rate barely moves, and eviction still works."""
    trace = _conversations()
    kw = dict(dram_bytes=2 << 20, nvme_bytes=12 << 20, eviction=eviction, maintenance=Collector)
    straight = store_replay(trace, 32768, **kw)
    restarted = store_replay(trace, 32768, restart_at=len(trace) // 2, **kw)
    assert 0.1 < straight["token_hit_rate"] < unlimited_hit_rate(trace)["token_hit_rate"]   # capacity binds
    assert restarted["token_hit_rate"] == pytest.approx(straight["token_hit_rate"], abs=0.02)
    assert restarted["tier_usage_at_end"]["nvme"]["used_bytes"] <= 12 << 20


@pytest.mark.skipif(not os.path.exists(TRACE), reason="the Mooncake trace is not in ../shared/traces")
def test_mooncake_trace_facts_and_cli(tmp_path):
    trace = load_trace(TRACE)
    u = unlimited_hit_rate(trace)
    assert (len(trace), u["blocks"], u["block_hits"], u["distinct_blocks"]) == (12031, 288500, 105710, 182790)
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "kvcache.cli.main", "replay", TRACE, "--limit", "400",
                        "--dram-tokens", "200K,1M", "--nvme-tokens", "3M", "--json", str(out)],
                       capture_output=True, text=True, check=True)
    doc = json.loads(out.read_text())
    assert len(doc["capacities"]) == 2 and "unlimited capacity" in r.stdout and doc["unlimited_hit_rate"] > 0
    for c in doc["capacities"]:
        assert 0 <= c["policy"]["token_hit_rate"] <= doc["unlimited_hit_rate"] + 1e-9
        assert c["lru_dram_only_hit_rate"] <= c["lru_same_total_hit_rate"] + 1e-9
        assert c["lru_same_total_hit_rate"] <= c["belady_same_total_hit_rate"] + 1e-9
        assert c["policy_vs_belady"] == pytest.approx(c["policy"]["token_hit_rate"] / c["belady_same_total_hit_rate"])
    assert doc["worst_policy_vs_lru"] == min(c["policy_vs_lru"] for c in doc["capacities"])
    assert len(doc["bounds"]["capacities"]) == 5 and "simulated policies" in r.stdout


@pytest.mark.skipif(not os.path.exists(TRACE), reason="the Mooncake trace is not in ../shared/traces")
def test_bounds_only_replays_the_whole_trace_in_seconds_with_a_plot(tmp_path):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    r = subprocess.run([sys.executable, "-m", "kvcache.cli.main", "replay", TRACE, "--bounds-only", "--grid", "1M,3M",
                        "--plot", str(png), "--json", str(out)], capture_output=True, text=True, check=True)
    b = json.loads(out.read_text())["bounds"]
    rows = {row["capacity_tokens"]: row for row in b["capacities"]}
    # the published shape of this trace: LRU far below the optimum where capacity is scarce
    assert rows[3_000_000]["rates"]["lru"] == pytest.approx(0.138, abs=0.005)
    assert rows[3_000_000]["rates"]["belady"] == pytest.approx(0.360, abs=0.005)
    assert b["scarce_capacity_tokens"] == [1_000_000, 3_000_000]
    assert png.stat().st_size > 10_000 and "worst against LRU" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "kvcache.cli.main", "replay", TRACE, "--bounds-only", "--policies",
                          "lfu"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown --policies" in bad.stderr


def test_cli_progress_is_lines_on_a_stderr_that_is_not_a_terminal(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 1024, "output_length": 8,
                                         "hash_ids": [0, i % 3]}) + "\n" for i in range(20)))
    r = subprocess.run([sys.executable, "-m", "kvcache.cli.main", "replay", str(trace), "--kv-bytes-per-token", "128",
                        "--dram-tokens", "2K", "--nvme-tokens", "8K"], capture_output=True, text=True, check=True)
    lines = r.stderr.splitlines()
    assert "\r" not in r.stderr and lines[0].startswith("replaying: 0/40 requests"), r.stderr
    assert lines[-1].startswith("replaying: 40/40 requests (100%)") and "unlimited capacity" in r.stdout


def test_line_progress_writes_a_line_every_interval():
    from kvcache.cli.fmt import LineProgress
    out, now = io.StringIO(), [0.0]
    with LineProgress(100, "replaying", "requests", every_s=10, file=out, clock=lambda: now[0]) as bar:
        for _ in range(100):
            now[0] += 0.25                  # 25 s in all: lines at 0, 10 and 20 s, and the end
            bar.update(1)
    lines = out.getvalue().splitlines()
    assert [line.split(" requests")[0] for line in lines] == [
        "replaying: 0/100", "replaying: 40/100", "replaying: 80/100", "replaying: 100/100"]
    assert "~15 s left" in lines[1] and lines[-1].endswith("(100%), 25 s")


def test_help_names_a_trace_a_user_can_get():
    out = subprocess.run([sys.executable, "-m", "kvcache.cli.main", "replay", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "../shared" not in out and "kvcache-ai/Mooncake" in out and "conversation_trace.jsonl" in out
