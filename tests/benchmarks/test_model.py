"""`kvcache bench model` at a tiny size: both sides run, the report has ratios and KV figures."""

import json

import pytest

pytest.importorskip("transformers")
from kvcache.benchmarks.model import format_table, run   # noqa: E402


def test_tiny_run_writes_the_report(tmp_path):
    doc = run(["v4-tiny"], [32, 64], str(tmp_path), decode_steps=3, baseline_max=32, progress=False)
    on_disk = json.loads((tmp_path / "model_forward-latest.json").read_text())
    assert on_disk == json.loads(json.dumps(doc))
    rows = on_disk["results"]["v4-tiny"]["lengths"]
    assert rows["32"]["prefill_ratio_ours_vs_transformers"] > 0 and rows["32"]["decode_ratio_ours_vs_transformers"] > 0
    assert "transformers" not in rows["64"]["prefill_tokens_per_s"]        # above --baseline-max-tokens
    kv = on_disk["kv_bytes_per_token"]
    assert kv["v4-flash"]["bf16"]["computed"] == 6880 and kv["v41-flash"]["v41_fp4+mxfp4_index"]["computed"] == 890
    assert "v4-tiny" in format_table(doc) and on_disk["machine"]["cpu_count"]


def test_codec_benchmark_on_model_kv(tmp_path):
    from kvcache.benchmarks.kv_codec import run as run_codec
    doc = run_codec(["v4-tiny", "v41-tiny"], 96, str(tmp_path), block_tokens=32)
    for name in ("v4-tiny", "v41-tiny"):
        r = doc["results"][name]
        assert r["history_rows"] > 0 and r["bytes"] > 0
        for codec in ("zstd", "zstd-shuffle2"):
            assert r[codec]["ratio"] > 0.5 and r[codec]["compress_gb_s"] > 0
    assert (tmp_path / "kv_codec-latest.json").exists()


def test_engine_benchmark_tiny(tmp_path):
    from kvcache.benchmarks.engine import format_table, run as run_engine
    doc = run_engine(["v4-tiny"], [1, 2], str(tmp_path), prompt_tokens=16, out_tokens=3, progress=False,
                     compile_=False)     # compiled engines: tests/engine/test_compiled.py
    row = doc["results"]["v4-tiny"]["b2"]
    assert row["ours"]["decode_tokens_per_s"] > 0 and row["transformers"]["decode_tokens_per_s"] > 0
    assert doc["decode_tokens_per_s_vs_hf_b1_eager"] > 0 and "eager" in format_table(doc)
    assert doc["decode_tokens_per_s_vs_hf_b1"] > 0 and "PASS" in format_table(doc) or "MISS" in format_table(doc)
    assert (tmp_path / "engine_throughput-latest.json").exists()
    top = row["ceiling"]           # the bandwidth bound: above what was measured, and reported as a ratio
    assert top["max_decode_tokens_per_s"] > row["ours"]["decode_tokens_per_s"] and top["read_bandwidth_gb_s"] > 0.5
    assert doc["max_decode_ratio_vs_hf_b1"] > 0 and "memory bandwidth allows" in format_table(doc)


def test_roofline_counts_the_experts_a_batch_selects():
    import os
    from kvcache.benchmarks.model import CONFIG_DIR
    from kvcache.engine.model_config import ModelConfig
    from kvcache.engine.models import build_model
    from kvcache.engine.roofline import ceiling, step_weight_bytes
    model = build_model(ModelConfig.load(os.path.join(CONFIG_DIR, "v4-tiny.json")))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    one, eight, many = (step_weight_bytes(model, b) for b in (1, 8, 10_000))
    assert one < eight < many <= total          # more tokens, more distinct experts, never more than the model
    embed = model.embed.weight
    drafter = sum(p.numel() * p.element_size() for p in model.mtp.parameters())
    assert drafter > 0                          # the MTP stage: not part of a plain decode step
    embed_bytes = embed.numel() * embed.element_size()
    assert many == total - drafter - embed_bytes + min(10_000, embed.shape[0]) * embed.shape[1] * 4
    top = ceiling(model, 8, 10e9)
    assert abs(top["max_decode_tokens_per_s"] - 8 * 10e9 / eight) < 1e-6


def test_decode_profile_counts_a_steps_ops(tmp_path):
    """benchmarks/decode_profile.py at a tiny size on the CPU: host ops counted per step (no
    launches or device time without a device), the report written and readable."""
    from kvcache.benchmarks.decode_profile import format_report, run as run_profile
    doc = run_profile("v4-tiny", "cpu", 2, 3, False, None, str(tmp_path))
    on_disk = json.loads((tmp_path / "decode_profile_cpu-latest.json").read_text())
    r = on_disk["results"]
    assert r["tpot_ms"] > 0 and r["aten_calls_per_step"] > 100 and r["launches_per_step"] == 0
    assert any(op["op"] == "aten::mm" for op in r["top_host_ops"])
    assert "v4-tiny b2 on cpu (eager)" in format_report(doc)
