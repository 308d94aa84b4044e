"""Prefix reuse end to end: the engine's pool, an in-process store (DRAM, NVMe, after a
restart) and the real daemon; exact mode bit-identical, bounded replay within tolerance; failed
blocks recomputed; a shared prefix loaded once; a failing store degrading to misses."""

import dataclasses

import pytest
import torch

from kvcache.engine.config import CacheConfig, EngineConfig
from kvcache.engine.llm import LLM
from kvcache.engine.sampling import SamplingParams
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.store import BlockStore
from kvcache.tiering.config import DramConfig, NvmeConfig
from tests.engine.test_engine import model  # noqa: F401  (the v4 / v41 tiny model fixture)

CFG = EngineConfig(block_size=16, num_blocks=128, max_tokens_per_step=48, max_running=8)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def prompts(seed: int, n_questions: int = 3, doc: int = 96):
    g = torch.Generator().manual_seed(seed)
    P = torch.randint(3, 380, (doc,), generator=g).tolist()
    return P, [torch.randint(3, 380, (7,), generator=g).tolist() for _ in range(n_questions)]


def cold(model, ps):
    return [LLM(model=model, config=CFG).generate([p], GREEDY)[0][0].token_ids for p in ps]


def cached(mode: str, **kw) -> EngineConfig:
    if mode == "exact":
        kw.setdefault("snapshot_interval", 48)          # snapshot points at 48 and 96 (the document's end)
    return dataclasses.replace(CFG, cache=CacheConfig(mode=mode, **kw))


def open_store(path) -> BlockStore:
    return BlockStore(StoreConfig(str(path), dram=DramConfig(capacity_bytes=64 << 20, page_bytes=1 << 20,
                                                             prefault=False),
                                  nvme=NvmeConfig(segment_bytes=4 << 20)))


def run(llm, ps):
    outs = [llm.generate([p], GREEDY)[0][0] for p in ps]
    return outs, [o.usage for o in outs]


def filled_store(model, tmp_path, seed: int, n_questions: int = 3):
    """(document, questions, store): the store holds an exact-mode run of the first question."""
    P, Qs = prompts(seed, n_questions)
    store = open_store(tmp_path)
    with LLM(model=model, config=cached("exact"), store=store) as first:
        run(first, [P + Qs[0]])
    return P, Qs, store


def _tapped(llm, into: dict, key) -> None:
    llm.engine.logits_hook = lambda req, pos, logits: into.setdefault((key, pos), logits.clone())


@torch.no_grad()
def test_bounded_replay_from_the_pool_keeps_greedy_tokens(model):
    """>= 99 % equal greedy tokens, and the logit error of replay measured (docs: benchmarks/README)."""
    agree = total = 0
    errors = []
    for seed in range(3):
        P, Qs = prompts(seed)
        ps = [P + q for q in Qs]
        cold_logits, warm_logits = {}, {}
        want = []
        for i, p in enumerate(ps):
            llm = LLM(model=model, config=CFG)
            _tapped(llm, cold_logits, i)
            want.append(llm.generate([p], GREEDY)[0][0].token_ids)
        llm = LLM(model=model, config=cached("replay"))
        outs = []
        for i, p in enumerate(ps):
            _tapped(llm, warm_logits, i)
            outs.append(llm.generate([p], GREEDY)[0][0])
        usage = [o.usage for o in outs]
        for w, o in zip(want, outs):
            agree += sum(a == b for a, b in zip(w, o.token_ids))
            total += len(w)
        assert usage[0].total_cached == 0
        for u, o in zip(usage[1:], outs[1:]):      # the document's 6 blocks from the pool, 2 replayed
            assert u.cached_tokens == {"hbm": 96} and u.replayed_tokens == 32
            assert o.metrics.tokens_computed == 32 + 7 + 9
        errors += [float((cold_logits[k] - v).abs().max() / cold_logits[k].abs().max())
                   for k, v in warm_logits.items() if k[0] > 0]
        llm.engine.check_idle()
    assert agree / total >= 0.99
    assert max(errors) < 1e-2, max(errors)     # measured: V4 4e-5, V4.1 5e-4 (max |delta| / max |logit|)


@torch.no_grad()
def test_exact_mode_from_dram_nvme_and_after_a_restart_is_bit_identical(model, tmp_path):
    P, Qs = prompts(7)
    ps = [P + q for q in Qs]
    want = cold(model, ps)
    store = open_store(tmp_path)
    with LLM(model=model, config=cached("exact"), store=store) as first:   # fills the store
        assert run(first, ps[:1])[0][0].token_ids == want[0]
    cold_logits, warm_logits = {}, {}
    plain = LLM(model=model, config=CFG)
    _tapped(plain, cold_logits, 1)
    plain.generate([ps[1]], GREEDY)
    with LLM(model=model, config=cached("exact"), store=store) as warm:    # a new engine: empty pool
        _tapped(warm, warm_logits, 1)
        outs, usage = run(warm, ps[1:2])
    assert outs[0].token_ids == want[1]
    assert cold_logits.keys() == warm_logits.keys()                       # and every logit, bit for bit
    assert all(torch.equal(cold_logits[k], warm_logits[k]) for k in cold_logits)
    assert usage[0].cached_tokens == {"dram": 96} and usage[0].bytes_loaded > 0
    assert outs[0].metrics.tokens_computed == 7 + 9                       # the document never recomputed
    store.close()
    store = open_store(tmp_path)                                          # restart: DRAM is empty
    with LLM(model=model, config=cached("exact"), store=store) as again:
        outs, usage = run(again, ps[2:])
    assert outs[0].token_ids == want[2] and usage[0].cached_tokens == {"nvme": 96}
    store.close()


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
def test_concurrent_requests_sharing_a_prefix_load_it_once(model, tmp_path):
    P, Qs, store = filled_store(model, tmp_path, 13, n_questions=4)
    want = cold(model, [P + q for q in Qs])
    with LLM(model=model, config=cached("exact"), store=store) as warm:
        outs = warm.generate([P + q for q in Qs[1:]], GREEDY)
        stats = warm.engine.cache.connector.stats
        usage = [warm.engine.requests[o[0].request_id].usage for o in outs]
    assert [o[0].token_ids for o in outs] == want[1:]
    assert stats["fetched_blocks"] == 6                      # one load of the document's 6 blocks
    assert sorted(tuple(u.cached_tokens) for u in usage) == [("dram",), ("hbm",), ("hbm",)]
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
def test_exact_mode_resumes_a_chat_where_the_last_turn_ended(model, tmp_path):
    """Turn 2 = turn 1 + its answer + a new message: it resumes at turn 1's end (mid-block),
    from the engine's memory and, in a new engine, from the store; bit-identical to cold."""
    g = torch.Generator().manual_seed(23)
    turn1 = torch.randint(3, 380, (70,), generator=g).tolist()
    store = open_store(tmp_path)
    with LLM(model=model, config=cached("exact"), store=store) as llm:
        answer = llm.generate([turn1], GREEDY)[0][0].token_ids
        turn2 = turn1 + answer + torch.randint(3, 380, (5,), generator=g).tolist()
        want = cold(model, [turn2])[0]
        outs, usage = run(llm, [turn2])
    end = len(turn1) + len(answer) - 1                  # the last answer token was sampled, not computed
    assert outs[0].token_ids == want and usage[0].total_cached == end == 79
    assert outs[0].metrics.tokens_computed == len(turn2) - end + len(want) - 1
    with LLM(model=model, config=cached("exact"), store=store) as fresh:
        outs, usage = run(fresh, [turn2])
    assert outs[0].token_ids == want and usage[0].cached_tokens == {"dram": end}
    store.close()


@torch.no_grad()
def test_a_tier_slower_than_recomputing_is_skipped(model, tmp_path):
    """The cost model: with NVMe measured at 1 kB/s, loading 96 tokens would take longer than
    computing them, so the request recomputes; at the default bandwidth it loads."""
    P, Qs = prompts(29)
    ps = [P + q for q in Qs]
    want = cold(model, ps[1:])
    store = open_store(tmp_path)
    with LLM(model=model, config=cached("exact"), store=store) as first:
        run(first, ps[:1])
    store.close()
    store = open_store(tmp_path)                                          # DRAM empty: blocks on NVMe
    with LLM(model=model, config=cached("exact"), store=store) as llm:
        llm.engine.cache.prefill_s_per_token = 1e-3
        llm.engine.cache.connector.bandwidth["nvme"] = 1e3
        outs, usage = run(llm, ps[1:2])
        assert outs[0].token_ids == want[0] and usage[0].total_cached == 0
        llm.engine.reset_prefix_cache()
        llm.engine.cache.prefill_s_per_token = 1e-3
        llm.engine.cache.connector.bandwidth["nvme"] = 5e8
        outs, usage = run(llm, ps[2:])
        assert outs[0].token_ids == want[1] and usage[0].cached_tokens.get("nvme") == 96
    store.close()


@torch.no_grad()
def test_a_store_never_serves_one_models_blocks_to_another(tmp_path):
    """Same config, other weights (a fine-tune, another seed): other block keys, so no hit and the
    cold tokens; `[cache] model_id` names the weights instead of checksumming them."""
    from tests.engine.tiny import randomize, v4_config
    from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    a, b = (randomize(DeepseekV4ForCausalLM(v4_config(num_nextn_predict_layers=0)), seed=s).eval() for s in (1, 2))
    P, Qs = prompts(23, n_questions=2)
    store = open_store(tmp_path)
    with LLM(model=a, config=cached("exact"), store=store) as first:
        run(first, [P + Qs[0]])
    with LLM(model=b, config=cached("exact"), store=store) as other:
        outs, usage = run(other, [P + Qs[1]])
        assert usage[0].total_cached == 0 and [o.token_ids for o in outs] == cold(b, [P + Qs[1]])
    with LLM(model=a, config=cached("exact"), store=store) as same:       # the same weights: a hit
        assert run(same, [P + Qs[1]])[1][0].total_cached > 0
    named = dataclasses.replace(CFG, cache=CacheConfig(mode="exact", snapshot_interval=48, model_id="tiny@1"))
    with LLM(model=a, config=named, store=store) as first:
        assert first.engine.namespace != LLM(model=a, config=cached("exact")).engine.namespace
        run(first, [P + Qs[0]])
    with LLM(model=a, config=named, store=store) as again:
        assert run(again, [P + Qs[1]])[1][0].total_cached > 0
    store.close()


@torch.no_grad()
def test_a_waiting_hit_gives_its_blocks_to_a_better_request(model, tmp_path):
    """A request resumed from the store waits (max_running) holding its loaded blocks; a better one
    that needs them gets them, and the holder finds them in the pool again later (found by
    review: the engine spun forever, nothing running). In a pool this small its blocks are
    reallocated meanwhile, so it loads or recomputes them again: the same tokens either way."""
    P, Qs, store = filled_store(model, tmp_path, 29)
    tight = dataclasses.replace(CFG, num_blocks=8, max_running=1,
                                cache=CacheConfig(mode="exact", snapshot_interval=48))
    with LLM(model=model, config=tight, store=store) as warm:
        e = warm.engine
        busy = e.add_request(Qs[2] * 2, GREEDY)
        e.step()
        holder = e.add_request(P + Qs[1], GREEDY)       # 6 blocks from the store; waits behind `busy`
        e.step()
        e.step()
        assert holder.status.value == "waiting" and len(holder.block_ids) == 6
        better = e.add_request(prompts(30, doc=40)[0], GREEDY, priority=-1)
        for _ in range(200):
            if not e.has_work():
                break
            e.step()
        assert not e.has_work() and all(r.finish_reason.value == "length" for r in (busy, holder, better))
        assert holder.output == cold(model, [P + Qs[1]])[0]
        e.check_idle()
    store.close()


@torch.no_grad()
def test_usage_reports_the_last_plan_and_samples_get_it_too(model, tmp_path):
    P, Qs, store = filled_store(model, tmp_path, 31)
    with LLM(model=model, config=cached("exact"), store=store) as warm:
        e = warm.engine
        r = e.add_request(P + Qs[1], SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=3, ignore_eos=True))
        preempted = 0
        while e.has_work():
            e.step()
            if r.status.value == "running" and r.output and preempted < 3:   # recompute after a hit, 3 times
                e.scheduler.preempt(r)
                preempted += 1
        assert preempted == 3 and r.usage.total_cached <= len(r.prompt)
        child = e.family(r.request_id)[1]
        assert child.usage is not None and child.usage.prompt_tokens == len(r.prompt)
        e.check_idle()
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


def test_exact_and_replay_engines_key_their_blocks_apart(tmp_path):
    """Blocks a replay engine computes after a bounded replay are approximate: an exact engine
    sharing the store must not resume from them."""
    from kvcache.engine.llm_engine import LLMEngine
    from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from tests.engine.tiny import randomize, v4_config
    model = randomize(DeepseekV4ForCausalLM(v4_config(num_nextn_predict_layers=0)), seed=1).eval()
    store = open_store(tmp_path)
    replay, exact = (LLMEngine(model, None, cached(mode), store=store) for mode in ("replay", "exact"))
    assert replay.namespace.id != exact.namespace.id
    assert replay.namespace.model_fingerprint == exact.namespace.model_fingerprint
    for e in (replay, exact):
        e.close()
    store.close()


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


@torch.no_grad()
def test_each_prompt_is_hashed_once(model, tmp_path, monkeypatch):
    """A prompt's block keys are computed once, when it is added: the pool's keys and the store
    lookup (here a miss, then a pool hit, then a store hit in a new engine) both use them."""
    from kvcache.engine import llm_engine
    hashed, real = [], llm_engine.hash_blocks
    monkeypatch.setattr(llm_engine, "hash_blocks", lambda ns, toks, *a, **k: hashed.append(len(toks)) or
                        real(ns, toks, *a, **k))
    P, Qs = prompts(43)
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)   # no generated block fills up
    store = open_store(tmp_path)
    with LLM(model=model, config=cached("replay"), store=store) as llm:
        first = llm.generate([P + Qs[0]], short)[0][0]
        again = llm.generate([P + Qs[0]], short)[0][0]
    with LLM(model=model, config=cached("replay"), store=store) as llm:
        stored = llm.generate([P + Qs[0]], short)[0][0]
    store.close()
    assert hashed == [len(P + Qs[0])] * 3
    assert first.usage.total_cached == 0 and again.usage.cached_tokens.get("hbm") and stored.usage.total_cached
