"""`kvcache bench lmcache`: parsing LMCache's bench output, the missing-LMCache exit, and (when
LMCache is installed: $KVCACHE_LMCACHE or `lmcache` on PATH) a real one-request run."""

import argparse
import json
import os
import shutil

import pytest

from kvcache.benchmarks import lmcache_side, store_verbs

LOG = """\x1b[32m[INFO]\x1b[0m starting
  [seq 3/cold] LOOKUP: 0/15 chunks hit (64.5 ms)
  [seq 3/cold] STORE: stored (3840 tokens, 241.4 ms, 1 writers)
  [seq 3/warm] LOOKUP: 15/15 chunks hit (54.3 ms)
  [seq 3/warm] RETRIEVE: retrieved (3840 tokens, 48.2 ms, 1 workers)
  [seq 4/cold] LOOKUP: 15/15 chunks hit (110.9 ms)
  [seq 4/cold] RETRIEVE: retrieved (3840 tokens, 310.5 ms, 1 workers)
  [seq 5/cold] STORE: failed (3840 tokens, 12.0 ms, 1 writers)
"""


def test_parse_bench_log_reads_each_phase_of_each_request():
    got = lmcache_side.parse_bench_log(LOG)
    assert got[3] == {"cold_lookup": 64.5, "cold_lookup_hits": 0, "cold_store": 241.4, "warm_lookup": 54.3,
                      "warm_lookup_hits": 15, "warm_retrieve": 48.2}
    assert got[4] == {"cold_lookup": 110.9, "cold_lookup_hits": 15, "cold_retrieve": 310.5}
    assert got[5]["cold_store_failed"] == "failed"


def test_shapes_match_lmcache_chunk_sizes():
    mla, mha = lmcache_side.SHAPES["mla"], lmcache_side.SHAPES["mha"]
    assert mla.chunk_bytes == 17_989_632 and mla.nbytes == 15 * 17_989_632
    assert mha.chunk_bytes == 32 << 20 and mha.nbytes == 256 << 20
    for s in (mla, mha):        # the bench stores whole 256-token chunks of num_tokens + 1 tokens
        assert (s.tokens + 1) // 256 == s.chunks


def test_the_install_recipe_the_hint_points_to_exists():
    readme = open(os.path.join(os.path.dirname(lmcache_side.__file__), "README.md")).read()
    section = readme[readme.index("## `kvcache bench lmcache`"):]
    assert "pip install --no-deps lmcache" in section and "KVCACHE_LMCACHE" in section


def test_the_daemon_side_and_the_report_on_a_tiny_shape(tmp_path, monkeypatch):
    """kvcache_side needs no LMCache: two requests of a tiny shape through a real daemon (durable
    puts, shared-memory gets, a restart); the report against made-up LMCache timings."""
    monkeypatch.setattr(lmcache_side, "INTERVAL_S", 0.0)
    tiny = lmcache_side.Shape("mla", "(1,256,16,1,576):bfloat16:1", 255, 3, 1 << 20)
    sock = tmp_path / "s"
    sock.mkdir()
    ours = lmcache_side.kvcache_side([tiny], 2, str(tmp_path), str(sock))
    ms = ours["ms"]["mla"]
    assert set(ms) == set(lmcache_side.PHASES) and all(len(v) == 2 and min(v) > 0 for v in ms.values())
    theirs = {"ms": {"mla": {p: [10.0, 20.0] for p in lmcache_side.PHASES}}}
    r = lmcache_side.summarize([tiny], ours, theirs)["mla"]
    k = r["median_ms"]["kvcache"]
    assert r["speedup_vs_lmcache"]["warm_retrieve"] == pytest.approx(20.0 / ms["warm_retrieve"][1])
    assert k["restart_lookup_plus_retrieve"] == pytest.approx(ms["restart_lookup"][1] + ms["restart_retrieve"][1])
    assert set(r["speedup_vs_lmcache"]) == set(lmcache_side.SPEEDUPS)
    table = lmcache_side.format_table({"shapes": {"mla": r}})
    assert "store_fsync_vs_no_fsync" in table and "restart_lookup_plus_retrieve" in table


def _args(tmp_path, *argv) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    store_verbs.add_lmcache_arguments(p, default_out_dir=str(tmp_path / "out"))
    return p.parse_args(list(argv))


def test_without_lmcache_it_exits_2_and_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVCACHE_LMCACHE", raising=False)
    args = _args(tmp_path, "--lmcache", str(tmp_path / "no-lmcache"))
    assert lmcache_side.run_args(args) == 2
    err = capsys.readouterr().err
    assert "--no-deps" in err and "benchmarks/README.md" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_shapes_are_checked(tmp_path):
    with pytest.raises(SystemExit):
        _args(tmp_path, "--shapes", "gqa")


LMCACHE = os.environ.get("KVCACHE_LMCACHE") or shutil.which("lmcache")


@pytest.mark.slow
@pytest.mark.skipif(not LMCACHE, reason="LMCache is not installed ($KVCACHE_LMCACHE or `lmcache` on PATH)")
def test_a_real_run_against_lmcache(tmp_path):
    doc = lmcache_side.run(["mla"], 1, str(tmp_path / "out"), lmcache=LMCACHE, data_dir=str(tmp_path))
    on_disk = json.loads((tmp_path / "out" / "lmcache_side-latest.json").read_text())
    r = on_disk["shapes"]["mla"]
    for side in ("kvcache", "lmcache"):
        assert all(v > 0 for v in r["median_ms"][side].values())
    assert set(r["speedup_vs_lmcache"]) >= {"store", "warm_retrieve", "restart_lookup_plus_retrieve"}
    assert "speedup" in lmcache_side.format_table(doc)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".kvcache-bench-")]
