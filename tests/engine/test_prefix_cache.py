"""Prefix reuse end to end, when it works: hits from the engine's pool, an in-process store
(DRAM, NVMe, after a restart); exact mode bit-identical, bounded replay within tolerance; a
shared prefix loaded once; the cost model; keys that tell models and modes apart; usage."""

import dataclasses

import torch

from kvcache.engine.config import CacheConfig
from kvcache.engine.llm import LLM
from kvcache.engine.sampling import SamplingParams
from tests.engine.prefix_cache_setup import (CFG, GREEDY, cached, cold, filled_store, open_store, prompts, run,
                                             tap_logits)
from tests.engine.test_engine import model  # noqa: F401  (the v4 / v41 tiny model fixture)


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
            tap_logits(llm, cold_logits, i)
            want.append(llm.generate([p], GREEDY)[0][0].token_ids)
        llm = LLM(model=model, config=cached("replay"))
        outs = []
        for i, p in enumerate(ps):
            tap_logits(llm, warm_logits, i)
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
    tap_logits(plain, cold_logits, 1)
    plain.generate([ps[1]], GREEDY)
    with LLM(model=model, config=cached("exact"), store=store) as warm:    # a new engine: empty pool
        tap_logits(warm, warm_logits, 1)
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
    that needs them gets them, and the holder finds them in the pool again later (rather than the
    engine spinning forever with nothing running). In a pool this small its blocks are
    reallocated meanwhile, so it loads or recomputes them again: the same tokens either way."""
    P, Qs, store = filled_store(model, tmp_path, 29)
    tight = dataclasses.replace(CFG, num_blocks=8, max_running=1,
                                cache=CacheConfig(mode="exact", snapshot_interval=48))
    with LLM(model=model, config=tight, store=store) as warm:
        e = warm.engine
        busy = e.add_request(Qs[2] * 2, GREEDY)
        e.step()
        holder = e.add_request(P + Qs[1], GREEDY)       # 6 blocks from the store; waits behind `busy`
        e.step()                                        # plans the hit: the loader thread fetches it
        plan = e.cache.plans[holder.request_id]
        assert plan.future is not None                  # loading from the store
        plan.future.result(timeout=60)                  # `busy` runs meanwhile: the step never waits on it
        e.step()                                        # applies the load: holder waits for `busy`
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
def test_each_prompt_is_hashed_once(model, tmp_path, monkeypatch):
    """A prompt's block keys are computed once, when it is added: the pool's keys and the store
    lookup (here a miss, then a pool hit, then a store hit in a new engine) both use them."""
    from kvcache.engine import request_builder
    hashed, real = [], request_builder.hash_blocks
    monkeypatch.setattr(request_builder, "hash_blocks", lambda ns, toks, *a, **k: hashed.append(len(toks)) or
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
