"""The structured-output benchmark end to end on the tiny V4.1 config: both sides of each pair run
the same decode steps, the constrained side fills masks, every schema's first build is timed
uncached, and the JSON is written."""

import json

import pytest
import torch

from kvcache.benchmarks.structured import Settings, Side, load_schemas, run
from kvcache.benchmarks.structured_grammar import vocab_size, wide_tokenizer_json
from kvcache.benchmarks.structured_report import format_table, summarize_ab


@pytest.fixture
def one_thread():
    """One torch thread: two spinning OpenMP threads on cores other tests share can make the tiny
    model's steps tens of times slower; the benchmark itself runs with the machine's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_structured_benchmark_on_the_tiny_config(tmp_path, one_thread):
    s = Settings(config="v41-tiny", batches=(1, 2), requests=2, repeats=1, max_tokens=5, fill_rows=(1, 3),
                 fill_iters=3, compile_passes=2, wide_vocab=600, wide_width=1000)
    doc = run(s, str(tmp_path / "out"), models_dir=str(tmp_path / "models"), progress=False)
    for b in ("b1", "b2"):
        r = doc["decode"][b]
        assert r["same_decode_steps"] and r["decode_tokens"] == sum(n - 1 for n in r["generated_tokens"])
        assert r["pairs"] == 2 // int(b[1:]) and len(r["generated_tokens"]) == 2
        assert r["fill_ms_per_step"] > 0 and 0 < r["fill_fraction_of_step"] < 1      # the masks were filled
        assert r["apply_ms_per_step"] > 0                                            # and applied
        assert doc[f"structured_decode_vs_free_{b}"] == r["ratio"] > 0
    assert doc["decode"]["b2"]["decode_steps"] == max(doc["decode"]["b2"]["generated_tokens"]) - 1
    schemas = len(load_schemas(None))
    for name, width in (("engine", 512), ("wide", 1000)):
        g = doc["grammar"][name]
        assert g["logit_width"] == width and g["compile"]["samples"] == 2 * schemas
        assert set(g["fill_batch"]) == {"1", "3"} and g["fill_batch"]["3"]["samples"] == 3
    assert doc["grammar"]["wide"]["tokenizer_vocab"] == 600
    saved = json.load(open(tmp_path / "out" / "structured-latest.json"))
    assert saved["structured_decode_vs_free_b1"] == doc["structured_decode_vs_free_b1"]
    assert saved["machine"]["cpu_count"] and "structured_decode_vs_free_b2" in format_table(doc)


def test_the_ratio_is_the_median_of_each_pairs_own_ratio():
    def side(tokens, seconds):
        return Side(counts=[tokens + 1], decode_tokens=tokens, decode_s=seconds, step_s=[seconds / tokens] * tokens,
                    all_steps_s=seconds, fill_s=0.001 * tokens, apply_s=0.0003 * tokens,
                    wait_s=0.0002 * tokens, masked_rows=tokens)
    # drift: the second pair runs at half the speed, the third at twice: each pair's ratio is 0.9 or 1
    pairs = [(side(10, 1.0), side(10, 0.9)), (side(10, 2.0), side(10, 2.0)), (side(10, 0.5), side(10, 0.45))]
    r = summarize_ab(pairs)
    assert r["ratios"] == pytest.approx([0.9, 1.0, 0.9]) and r["ratio"] == pytest.approx(0.9)
    assert r["ratio_of_totals"] == pytest.approx(3.35 / 3.5)          # the slow pair weighs most
    assert r["same_decode_steps"] and r["fill_ms_per_step"] == pytest.approx(10 / 11)
    assert r["fill_wait_ms_per_step"] == pytest.approx(2 / 11) and r["fill_hidden_fraction"] == pytest.approx(0.8)


def test_schemas_come_from_a_directory_when_given(tmp_path):
    (tmp_path / "b.json").write_text('{"type": "integer"}')
    (tmp_path / "a.json").write_text('{"type": "string"}')
    (tmp_path / "notes.txt").write_text("not a schema")
    assert load_schemas(str(tmp_path)) == [("a", {"type": "string"}), ("b", {"type": "integer"})]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\*.json schemas"):
        load_schemas(str(tmp_path / "empty"))


def test_the_wide_tokenizer_has_the_size_asked_and_the_same_tokens_every_time():
    text = wide_tokenizer_json(700, seed=1)
    assert vocab_size(text) == 700 and wide_tokenizer_json(700, seed=1) == text
