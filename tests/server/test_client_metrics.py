"""A named client's traffic (X-KVCache-Client over HTTP, the shared-memory HELLO) gets series of its
own in the daemon's metrics and a row of its own in `kvcache report`; a name outside the known set
is "other", so clients cannot grow the label's cardinality."""

from __future__ import annotations

import argparse
import json
import re

import numpy as np
import pytest

from kvcache.cli.report import cmd_report
from kvcache.client.sync_client import KVClient
from kvcache.kvstore import Namespace, hash_blocks
from kvcache.kvstore.types import PutItem
from kvcache.server.metrics import client_label
from tests.daemon_proc import DaemonProcess

NS = Namespace("client-metrics@1", "raw", 16, name="cm")


def series(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_client_labels_are_a_closed_set():
    assert client_label(None) == "" and client_label("") == ""
    assert client_label("vLLM") == "vllm" and client_label("sglang") == "sglang"
    assert client_label("x" * 500) == "other" and client_label("evil\nname") == "other"


@pytest.mark.parametrize("shared_memory", ["off", "on"])
def test_named_client_traffic_in_metrics_and_report(tmp_path, shared_memory, capsys):
    keys = hash_blocks(NS, np.arange(64))
    with DaemonProcess(tmp_path / "data") as d:
        with KVClient(d.url, client_name="vllm", shared_memory=shared_memory) as c, KVClient(d.url) as plain:
            nid = c.register_namespace(NS)
            c.put_many([PutItem(k, bytes([i]) * 4096, nid) for i, k in enumerate(keys[:3])])
            assert c.lookup(keys, namespace_id=nid).num_hits == 3
            assert c.get_many(keys[:4])[:3] == [bytes([i]) * 4096 for i in range(3)]
            plain.lookup(keys)                                 # unnamed: counted, but not as a client
            with KVClient(d.url, client_name="made-up") as other:
                other.lookup(keys[:1])
        text = d.call("GET", "/metrics")[1].decode()
        d.stop()
    assert series(text, "kvcache_client_blocks_total", client="vllm", op="lookup", result="hit", tier="dram") == 3
    assert series(text, "kvcache_client_blocks_total", client="vllm", op="put", result="stored", tier="any") == 3
    assert series(text, "kvcache_client_blocks_total", client="vllm", op="get", result="hit", tier="dram") == 3
    assert series(text, "kvcache_client_bytes_total", client="vllm", op="get", tier="dram") == 3 * 4096
    assert series(text, "kvcache_client_bytes_total", client="vllm", op="put", tier="any") == 3 * 4096
    assert series(text, "kvcache_client_blocks_total", client="other", op="lookup", result="hit", tier="dram") == 1
    assert series(text, "kvcache_blocks_total", op="lookup", result="hit", tier="dram") == 3 + 3 + 1
    if shared_memory == "off":      # a read through the shared read directory costs the daemon nothing to time
        assert 'kvcache_client_read_seconds_count{client="vllm",tier="dram"}' in text
    assert cmd_report(argparse.Namespace(data_dir=str(tmp_path / "data"), since=None, out=None, json=True)) == 0
    rows = {r["client"]: r for r in json.loads(capsys.readouterr().out)["clients"]}
    assert set(rows) == {"vllm", "other"}
    assert rows["vllm"]["lookups"] == 1 and rows["vllm"]["hit"] == 3 * 16 and rows["vllm"]["requested"] == 4 * 16
    assert rows["vllm"]["hit_tokens_by_tier"]["dram"] == 3 * 16
