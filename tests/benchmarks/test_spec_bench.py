"""`kvcache bench spec` end to end on the tiny configs (seconds of distillation, one round):
the JSON has the named ratios, the outputs matched, the table prints."""

import json

from tests.cli.command import kv


def test_spec_bench_smoke(tmp_path):
    r = kv("bench", "spec", "--models", "v4-tiny,v41-tiny", "--batches", "1,2", "--repeats", "1",
           "--max-tokens", "12", "--distill-seconds", "3", "--models-dir", str(tmp_path / "models"),
           "--out-dir", str(tmp_path), "--no-progress")
    doc = json.loads((tmp_path / "spec-latest.json").read_text())
    for key in ("spec_decode_speedup_b1", "spec_decode_speedup_b2", "mean_accepted_tokens", "machine"):
        assert key in doc, key
    assert doc["async_sched_speedup"] > 0
    for m in doc["models"].values():
        assert m["b1"]["same_tokens"] and m["b2"]["same_tokens"]
        # at least the verified token per round; or no round at all: on a loaded 2-core host DSpark's
        # draft budget (measured step costs) may find that these seconds-distilled drafts never pay
        b1 = m["b1"]
        assert b1["mean_accepted_tokens"] >= 1.0 or (b1["mean_accepted_tokens"] == 0.0 and b1["mean_drafts"] == 0.0)
    assert "spec_decode_speedup_b1" in r.stdout and doc["models"]["v41-tiny"]["method"] == "dspark"
