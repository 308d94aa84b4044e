"""Prefix reuse when the store misbehaves: blocks that fail to load are recomputed, a store
that is down or not up yet is a miss (never a failure), the daemon restarts, a malformed end
snapshot is a miss, and a fetch leaves other holders' hard pins alone."""

import pytest
import torch

from kvcache.engine.llm import LLM
from tests.engine.prefix_cache_setup import CFG, GREEDY, cached, cold, filled_store, open_store, prompts, run
from tests.engine.test_engine import model  # noqa: F401  (the v4 / v41 tiny model fixture)


class FlakyStore:
    """A store whose chosen keys read back as None (a corrupt or vanished block) and that can fail
    every call (a store that is down)."""

    def __init__(self, inner, bad=(), down=False):
        self.inner, self.bad, self.down = inner, set(bad), down

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*a, **kw):
            if self.down and name != "register_namespace":
                raise OSError("store unreachable")
            out = fn(*a, **kw)
            if name == "get_many":
                return [None if k in self.bad else p for k, p in zip(a[0], out)]
            return out
        return call


@torch.no_grad()
@pytest.mark.parametrize("mode", ["exact", "replay"])
def test_a_block_failing_to_load_is_recomputed(model, tmp_path, mode):
    P, Qs = prompts(11)
    ps = [P + q for q in Qs[:2]]
    want = cold(model, ps)
    store = open_store(tmp_path)
    with LLM(model=model, config=cached(mode), store=store) as first:
        run(first, ps[:1])
        keys = first.engine.requests[next(iter(first.engine.requests))].block_keys
    flaky = FlakyStore(store, bad={keys[3]})
    with LLM(model=model, config=cached(mode), store=flaky) as warm:
        outs, usage = run(warm, ps[1:])
    assert usage[0].failed_blocks == 3                       # blocks 3, 4, 5: the hit ends at the bad one
    if mode == "exact":
        assert outs[0].token_ids == want[1] and usage[0].total_cached == 0
    else:                                                    # blocks 0..2 kept, the last 2 of them replayed
        assert usage[0].cached_tokens == {"dram": 48} and usage[0].replayed_tokens == 32
        assert sum(a == b for a, b in zip(outs[0].token_ids, want[1])) >= 9
    store.close()


@torch.no_grad()
def test_a_store_that_is_down_is_a_miss_never_a_failure(model, tmp_path):
    P, Qs = prompts(17)
    want = cold(model, [P + Qs[0]])
    store = open_store(tmp_path)
    down = FlakyStore(store, down=True)
    with LLM(model=model, config=cached("exact"), store=down) as llm:
        outs, usage = run(llm, [P + Qs[0]])
        stats = llm.engine.cache.connector.stats
        llm.engine.cache.connector.flush()
    assert outs[0].token_ids == want[0] and usage[0].total_cached == 0
    assert stats["lookup_errors"] >= 1 and stats["save_errors"] >= 1
    store.close()


@torch.no_grad()
def test_exact_mode_through_the_daemon_and_after_its_restart(model, tmp_path):
    from kvcache.client.sync_client import KVClient
    from tests.server.test_serve_process import Daemon
    P, Qs = prompts(19)
    ps = [P + q for q in Qs]
    want = cold(model, ps)
    d = Daemon(tmp_path / "data")
    try:
        d.wait_ready()
        with KVClient(d.url, retries=1) as client:
            with LLM(model=model, config=cached("exact"), store=client) as first:
                run(first, ps[:1])
            with LLM(model=model, config=cached("exact"), store=client) as warm:
                outs, usage = run(warm, ps[1:2])
        assert outs[0].token_ids == want[1] and usage[0].cached_tokens == {"dram": 96}
        assert d.stop() and d.proc.returncode == 0
        d = Daemon(tmp_path / "data")                        # restart: the blocks come back from NVMe
        d.wait_ready()
        with KVClient(d.url, retries=1) as client, \
                LLM(model=model, config=cached("exact"), store=client) as again:
            outs, usage = run(again, ps[2:])
        assert outs[0].token_ids == want[2] and usage[0].cached_tokens == {"nvme": 96}
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


@torch.no_grad()
def test_a_daemon_not_up_yet_is_a_miss_then_used_once_it_answers(model, tmp_path, monkeypatch, caplog):
    """No daemon at the URL: generation runs uncached with one warning; the daemon comes up and
    the same engine stores and hits through it; the daemon dies mid-run: misses again, one more
    warning, and no unclosed client session when the engine closes."""
    import gc
    import logging
    import time
    from kvcache.engine.cache import connector
    from tests.server import test_serve_process as serve
    monkeypatch.setattr(connector, "RETRY_S", 0.2)
    port = serve.free_port()
    monkeypatch.setattr(serve, "free_port", lambda: port)
    P, Qs = prompts(29, n_questions=4)
    ps = [P + q for q in Qs]
    want = cold(model, ps)
    caplog.set_level(logging.WARNING)
    unreachable = lambda: sum("is unreachable" in r.getMessage() for r in caplog.records)   # noqa: E731
    d = None
    llm = LLM(model=model, config=cached("exact", store=f"http://127.0.0.1:{port}"))
    try:
        conn = llm.engine.cache.connector
        outs, usage = run(llm, ps[:2])
        assert [o.token_ids for o in outs] == want[:2] and usage[0].total_cached == 0
        assert usage[1].cached_tokens == {"hbm": 96}          # the engine's own pool works without the store
        assert unreachable() == 1 and conn.stats["store_down"] >= 2
        d = serve.Daemon(tmp_path / "data")
        d.wait_ready()
        deadline = time.monotonic() + 30
        while not conn.available() and time.monotonic() < deadline:   # the probe runs in the background
            time.sleep(0.05)
        assert conn.available()
        llm.engine.reset_prefix_cache()              # the pool's copies aside: only the daemon can serve
        run(llm, ps[2:3])
        conn.flush()
        llm.engine.reset_prefix_cache()
        outs, usage = run(llm, ps[3:4])
        assert outs[0].token_ids == want[3] and usage[0].cached_tokens == {"dram": 96}
        d.proc.kill()
        d.proc.wait()
        llm.engine.reset_prefix_cache()
        outs, usage = run(llm, ps[:1])
        assert outs[0].token_ids == want[0] and usage[0].total_cached == 0 and unreachable() == 2
    finally:
        llm.close()
        if d is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
    gc.collect()
    assert "Unclosed" not in caplog.text


@pytest.mark.parametrize("bad", ["partial of the wrong size", "no layers"])
@torch.no_grad()
def test_a_malformed_end_snapshot_in_the_store_is_a_miss(tmp_path, bad):
    """A store's bytes are input. An end snapshot whose partial block does not fit the pool used
    to fail the step and strand the request (and a block); one of no layers would have resumed
    with empty windows: wrong tokens. Both are misses: the same tokens as a cold run."""
    from kvcache.engine.cache import snapshot
    from kvcache.kvstore.hashing import end_snapshot_key
    from kvcache.engine.llm_engine import LLMEngine
    from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from kvcache.kvstore.types import PutItem
    from tests.engine.tiny import randomize, v4_config
    model = randomize(DeepseekV4ForCausalLM(v4_config(num_nextn_predict_layers=0)), seed=1).eval()
    prompt = list(range(3, 13))                     # no full block: an end snapshot at 9 tokens is looked up
    cold = LLM(model=model, config=CFG).generate([prompt], GREEDY)[0][0].token_ids
    store = open_store(tmp_path)
    eng = LLMEngine(model, None, cached("exact", snapshot_interval=16), store=store)
    if bad == "no layers":
        rows = torch.zeros(eng.cache.connector.block_bytes, dtype=torch.uint8)   # a partial block that fits
        snap = {"length": 9, "extra": {}, "layers": [], "partial": rows}
    else:
        snap = {"length": 9, "extra": {}, "layers": [], "partial": torch.zeros(7, dtype=torch.uint8)}
    key = end_snapshot_key(eng.namespace.id, prompt[:9], eng.namespace.algo.digest_size)
    store.put_many([PutItem(key, snapshot.encode(snap), eng.cache.connector.namespace_id)])
    req = eng.add_request(prompt, GREEDY)
    for _ in range(40):
        if not eng.has_work():
            break
        eng.step()
    assert req.finished and req.output == cold and not eng.has_work()
    eng.check_idle()
    eng.close()
    store.close()


@torch.no_grad()
def test_a_fetch_leaves_anothers_hard_pin_alone(model, tmp_path):
    P, Qs, store = filled_store(model, tmp_path, 37)
    from kvcache.kvstore.hashing import hash_blocks
    with LLM(model=model, config=cached("exact"), store=store) as warm:
        keys = hash_blocks(warm.engine.namespace, P)
        store.pin(keys)                                        # an operator's hard pins
        assert run(warm, [P + Qs[1]])[1][0].total_cached > 0   # the fetch pinned and read them
    assert all(m.hard_pins == 1 for m in store.index.get_many(keys))
    store.close()
