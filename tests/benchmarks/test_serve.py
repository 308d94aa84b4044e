"""`kvcache bench serve` on the tiny config: the workload keeps the trace's prefix structure token
for token, and a small run end to end (real servers over HTTP) reports every figure, with cached
tokens when the cache is on and none when it is off."""

import json
import os

import pytest

from kvcache.benchmarks import serve, serve_servers
from kvcache.benchmarks.serve_report import format_table
from kvcache.benchmarks.serve_workload import WorkloadShape, build_workload, prompt_text, sessions_of, word_ids
from kvcache.engine.tokenizer import load_tokenizer

SHARED_TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"


def _row(t_ms, hashes, tail=300, out=160):
    return {"timestamp": t_ms, "input_length": 512 * (len(hashes) - 1) + tail, "output_length": out,
            "hash_ids": hashes}


# three conversations (each turn starts with the last one's blocks),
# one request that shares only block 0 (everyone's system prompt), all starting with block 0
ROWS = [_row(0, [0, 1, 2, 3, 4, 5]), _row(0, [0, 10, 11, 12, 13, 14]), _row(500, [0, 20, 21, 22, 23]),
        _row(1000, [0, 30, 31]), _row(2000, [0, 1, 2, 3, 4, 5, 6, 7]), _row(2500, [0, 10, 11, 12, 13, 14, 15]),
        _row(3000, [0, 20, 21, 22, 23, 24])]


@pytest.fixture(scope="module")
def tokenizer(v4_tiny_checkpoint):
    return load_tokenizer(str(v4_tiny_checkpoint))


def test_sessions_group_turns_by_shared_prefix_beyond_block_0():
    assert sessions_of(ROWS) == [[0, 4], [1, 5], [2, 6], [3]]


def test_workload_keeps_prefixes_token_for_token(tokenizer):
    shape = WorkloadShape(block_tokens=16, max_requests=10, time_scale=0.5, max_output_tokens=8)
    w = build_workload(ROWS, tokenizer, shape, hit_unit=16)
    assert [len(s) for s in w.sessions] == [2, 2, 2]               # the single-turn request is left out
    first, second = w.sessions[0]
    assert len(first.prompt_ids) == 1 + 5 * 16 + 10               # BOS, five whole blocks, 300/512 of one
    assert second.prompt_ids[:91] == first.prompt_ids             # a hash id's tokens, however many are used
    assert second.arrival_s == pytest.approx(1.0) and first.max_tokens == 5
    assert second.ideal_cached == 80 and first.ideal_cached == 0  # 91 shared tokens, in 16-token units
    other = w.sessions[1][0].prompt_ids
    assert other[:17] == first.prompt_ids[:17] and other[17:33] != first.prompt_ids[17:33]    # block 0 only
    words = set(word_ids(tokenizer))
    for t in w.turns:
        assert t.prompt_ids[0] == tokenizer.bos_id and set(t.prompt_ids[1:]) <= words
        assert tokenizer.encode(prompt_text(t, tokenizer, tokenizer.decode([tokenizer.bos_id]))) == t.prompt_ids
    again = build_workload(ROWS, tokenizer, shape, hit_unit=16)
    assert [t.prompt_ids for t in again.turns] == [t.prompt_ids for t in w.turns]


def test_workload_from_the_shared_trace_is_multi_turn(tokenizer):
    if not os.path.exists(SHARED_TRACE):
        pytest.skip(f"{SHARED_TRACE} is not on this machine")
    shape = WorkloadShape(block_tokens=16, max_requests=12, max_prompt_tokens=512)
    w = build_workload(serve.read_trace(SHARED_TRACE), tokenizer, shape, hit_unit=64)
    stats = w.stats()
    assert stats["requests"] == 12 and stats["prompt_tokens"]["max"] <= 512
    assert stats["first_turns"] < 12 and 0 < stats["ideal_cached_fraction"] < 1


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One small run: cache on and off, and transformers serve where it can run here."""
    out = tmp_path_factory.mktemp("serve")
    trace = out / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    shape = WorkloadShape(block_tokens=16, max_requests=6, max_output_tokens=4, time_scale=0.2)
    transformers = "auto" if serve_servers.serve_available() is None else "off"
    doc = serve.run("v4-tiny", shape, clients=4, deadline_s=240, transformers=transformers, trace=str(trace),
                    snapshot_interval=64, server_env={"OMP_WAIT_POLICY": "PASSIVE"}, out_dir=str(out),
                    progress=False)
    return doc, json.load(open(out / "serve-latest.json"))


def test_server_env_is_key_value(capsys):
    from kvcache.benchmarks.verbs import VERBS
    import argparse
    p = VERBS["serve"].configure(argparse.ArgumentParser())
    assert p.parse_args(["--server-env", "OMP_WAIT_POLICY=PASSIVE", "--server-env", "A=b=c"]).server_env == \
        [("OMP_WAIT_POLICY", "PASSIVE"), ("A", "b=c")]
    with pytest.raises(SystemExit):
        p.parse_args(["--server-env", "no-equals"])
    assert "'no-equals' is not KEY=VALUE" in capsys.readouterr().err


def test_a_tiny_run_end_to_end(tiny_run):
    doc, saved = tiny_run
    assert saved["benchmark"] == "serve" and "machine" in saved and saved["workload"]["requests"] == 6
    on, off = (saved["scenarios"][k]["summary"] for k in ("cache_on", "cache_off"))
    for s in (on, off):
        assert s["completed"] == 6 and s["errors"] == 0, s["error_reasons"]
        assert s["ttft_p50_s"] > 0 and s["ttft_p99_s"] >= s["ttft_p50_s"] and s["tpot_p50_s"] > 0
        assert s["request_throughput_per_s"] > 0 and s["prompt_tokens"] == saved["workload"]["prompt_tokens"]["total"]
    assert on["cached_fraction"] > 0 and off["cached_fraction"] == 0
    for name in ("cache_on", "cache_off"):                        # every server gets the run's environment
        argv = saved["scenarios"][name]["server"]["argv"]
        assert argv[:2] == ["env", "OMP_WAIT_POLICY=PASSIVE"] and "--model" in argv
    assert saved["serve_errors"] == 0 and saved["serve_ttft_p50_cache_vs_off"] > 0
    assert set(saved["targets"]) == {"serve_ttft_p50_cache_vs_off", "serve_throughput_vs_transformers",
                                     "serve_errors"}
    assert {"ttft", "throughput", "errors"} <= set(saved["notes"])
    assert "cache_on" in format_table(doc) and "serve_errors = 0" in format_table(doc)


def test_transformers_serve_on_the_same_weights(tiny_run):
    why = serve_servers.serve_available()
    if why is not None:
        pytest.skip(why)
    _, saved = tiny_run
    tf = saved["scenarios"]["transformers"]
    assert tf["prompts_encoded_alike"] == 6 and tf["summary"]["completed"] == 6, tf["summary"]["error_reasons"]
    assert tf["summary"]["cached_fraction"] is None                # it reports no cached tokens
    if not tf["continuous_batching"]:                              # refused: what it answered, and why
        assert "HTTP 500" in tf["continuous_batching_refused"] and "Error: " in tf["continuous_batching_refused"]
    assert saved["serve_throughput_vs_transformers"] > 0
