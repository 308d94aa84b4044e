"""The engine on the tiny V4 and V4.1 models: batched == one by one, seeded sampling independent of
the batch and of preemption, n > 1 shares prompt blocks, failures stay with their request."""

import pytest
import torch

from kvcache.engine.layers.engram import compressed_token_map
from kvcache.engine.llm import LLM
from kvcache.engine.config import EngineConfig
from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from kvcache.engine.models.deepseek_v41 import DeepseekV41ForCausalLM
from kvcache.engine.sampling import SamplingParams, uniform
from kvcache.engine.tokenizer import build_demo_tokenizer
from tests.engine.tiny import randomize, v4_config, v41_config

CFG = EngineConfig(block_size=16, num_blocks=64, max_tokens_per_step=48, max_running=8)


@pytest.fixture(scope="module", params=["v4", "v41"])
def model(request):
    if request.param == "v4":
        return randomize(DeepseekV4ForCausalLM(v4_config(num_nextn_predict_layers=0)), seed=1).eval()
    tm = compressed_token_map(build_demo_tokenizer(512))
    m = randomize(DeepseekV41ForCausalLM(v41_config(int(tm.max()) + 1, num_nextn_predict_layers=0)), seed=1)
    m.set_token_map(tm)
    return m.eval()


def prompts(k=5):
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, 380, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (k,), generator=g)]


def tokens(outs):
    return [[c.token_ids for c in group] for group in outs]


def test_batched_generation_equals_one_by_one(model):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ps = prompts()
    batched = tokens(LLM(model=model, config=CFG).generate(ps, greedy))
    alone = [tokens(LLM(model=model, config=CFG).generate([p], greedy))[0] for p in ps]
    assert batched == alone


def test_seeded_sampling_ignores_batch_composition_and_preemption(model):
    p = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    ps = prompts(6)
    alone = tokens(LLM(model=model, config=CFG).generate([ps[0]], p))[0]
    crowd = tokens(LLM(model=model, config=CFG).generate(ps, p))[0]
    tight = EngineConfig(block_size=16, num_blocks=5, max_tokens_per_step=32, max_running=6)
    llm = LLM(model=model, config=tight)
    squeezed = tokens(llm.generate(ps, p))
    assert alone == crowd == squeezed[0]
    assert sum(r.metrics.preemptions for r in llm.engine.requests.values()) > 0   # the pool was too small
    llm.engine.check_idle()


def test_n_samples_fork_and_share_prompt_blocks(model):
    llm = LLM(model=model, config=CFG)
    p = SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=7, ignore_eos=True)
    prompt = prompts(1)[0] * 2                       # 2+ full blocks
    req = llm.engine.add_request(prompt, p)
    while req.metrics.first_token is None:           # prefill (chunked): the parent samples, two children fork
        llm.engine.step()
    kids = [llm.engine.requests[f"{req.request_id}/{i}"] for i in (1, 2)]
    full = len(prompt) // CFG.block_size
    assert all(k.block_ids[:full] == req.block_ids[:full] for k in kids)
    assert all(llm.engine.pool.blocks[b].ref_count == 3 for b in req.block_ids[:full])
    while llm.engine.has_work():
        llm.engine.step()
    outs = [req.output] + [k.output for k in kids]
    assert len({tuple(o) for o in outs}) > 1 and all(len(o) == 6 for o in outs)
    llm.engine.check_idle()


def test_bad_requests_are_refused_before_compute(model):
    llm = LLM(model=model, config=CFG)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        llm.generate([[1, 2, 10_000]])
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * 10], SamplingParams(max_tokens=model.config.max_position_embeddings))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        llm.generate(["hello"])


def test_a_failing_request_fails_alone(model, monkeypatch):
    llm = LLM(model=model, config=CFG)
    poison = 377
    real_run = model.run

    def run(chunks, states, collect=()):
        if any(poison in ch.tolist() for ch in chunks):
            raise RuntimeError("injected fault")
        return real_run(chunks, states, collect)
    monkeypatch.setattr(model, "run", run)
    ps = prompts(3)
    ps[1] = ps[1] + [poison]
    outs = llm.generate(ps, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert outs[1][0].finish_reason == "error" and "injected fault" in outs[1][0].error
    assert [len(o[0].token_ids) for o in (outs[0], outs[2])] == [5, 5]
    monkeypatch.undo()
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    assert tokens([outs[0]])[0] == tokens(LLM(model=model, config=CFG).generate([ps[0]], greedy))[0]
    llm.engine.check_idle()


def test_abort_frees_everything(model):
    llm = LLM(model=model, config=CFG)
    r = llm.engine.add_request(prompts(1)[0], SamplingParams(max_tokens=50, temperature=0))
    llm.engine.step()
    llm.engine.step()
    assert r.block_ids
    llm.engine.abort(r.request_id)
    assert r.finish_reason.value == "abort" and not llm.engine.has_work()
    llm.engine.check_idle()


def test_uniform_is_a_pure_function_of_its_keys():
    assert uniform(1, 2, 0) == uniform(1, 2, 0)
    draws = {uniform(7, pos, s) for pos in range(200) for s in range(3)}
    assert len(draws) == 600 and all(0 <= u < 1 for u in draws)


@pytest.mark.parametrize("overlap", [False, True])
async def test_async_engine_streams_concurrently_and_aborts(model, overlap):
    import asyncio
    import dataclasses
    from kvcache.engine.async_engine import AsyncEngine
    from kvcache.engine.llm_engine import LLMEngine
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ps = prompts(3)
    want = tokens(LLM(model=model, config=CFG).generate(ps, greedy))
    engine = LLMEngine(model, None, dataclasses.replace(CFG, async_scheduling=overlap))
    async with AsyncEngine(engine) as aeng:
        async def collect(p):
            got = []
            async for out in aeng.generate(p, greedy):
                got += out.new_tokens
            return got
        results = await asyncio.gather(*(collect(p) for p in ps))
        assert [[r] for r in results] == want
        stream = aeng.generate(ps[0], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        first = await stream.__anext__()
        assert first.new_tokens and not first.finished
        await stream.aclose()                          # the consumer leaves: the request is aborted
        for _ in range(50):
            if not engine.has_work():
                break
            await asyncio.sleep(0.02)
        assert not engine.has_work()
    engine.check_idle()


def test_completed_blocks_get_content_keys_that_outlive_the_request(model):
    from kvcache.kvstore.hashing import hash_blocks
    llm = LLM(model=model, config=CFG)
    prompt = (prompts(1)[0] * 3)[:40]                  # 2 full blocks of 16, then 8 tokens
    req = llm.engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    while llm.engine.has_work():
        llm.engine.step()
    keys = hash_blocks(llm.engine.namespace, req.tokens[:48])           # 40 + 10 tokens: 3 blocks computed
    assert req.block_keys == keys[: len(req.block_keys)] and len(req.block_keys) == 3
    assert all(llm.engine.pool.lookup(k) is not None for k in keys)     # cached: released, not yet reused
    assert llm.engine.pool.counts()["cached"] == 3
    llm.engine.check_idle()


@torch.no_grad()
def test_history_rows_live_in_the_pool_blocks(model):
    from kvcache.engine.layers.history import BlockRows
    llm = LLM(model=model, config=CFG)
    prompt = (prompts(1)[0] * 4)[:50]
    req = llm.engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    while req.num_computed < 60:
        llm.engine.step()
    dense = model.new_state()
    model(torch.tensor([req.tokens[: req.num_computed]]), dense)
    owners = [i for i, st in enumerate(req.state.layers) if st.compressor is not None]
    assert owners and llm.engine.kv.nbytes > 0
    for i in owners:
        paged = req.state.layers[i].compressor.rows
        assert isinstance(paged, BlockRows) and paged.table is req.block_ids
        want = dense.layers[i].compressor.entries
        assert torch.allclose(paged.view(), want, atol=1e-5) and paged.count == want.shape[1] > 0
        lane = paged.lane                               # block 0 of the request holds rows 0 .. per_block-1
        n0 = min(paged.per_block, paged.count)
        assert torch.allclose(lane[req.block_ids[0], :n0], want[0, :n0], atol=1e-5)
    from kvcache.engine.layers.history import SlotRows
    for i, st in enumerate(req.state.layers):           # windows (and carry) sit in the request's pool slot
        cell = st.__dict__["_window"]
        assert isinstance(cell, SlotRows) and cell.lane is llm.engine.kv.slot_lanes[(i, "window")]
        assert cell.slot == req.slot and torch.equal(st.window, dense.layers[i].window) or \
            torch.allclose(st.window, dense.layers[i].window, atol=1e-5)
    llm.engine.abort(req.request_id)
    llm.engine.check_idle()


@torch.no_grad()
def test_pool_blocks_round_trip_through_the_block_store(model, tmp_path):
    """A block's history rows, encoded with the pool's layout, stored, read back into another block."""
    from kvcache.engine.cache.block_payload import block_layout, decode_block, encode_block, layout_id
    from kvcache.kvstore.config import StoreConfig
    from kvcache.kvstore.hashing import Namespace
    from kvcache.kvstore.store import BlockStore
    from kvcache.kvstore.types import PutItem
    llm = LLM(model=model, config=CFG)
    eng = llm.engine
    req = eng.add_request((prompts(1)[0] * 4)[:48], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while req.num_computed < 48:
        eng.step()
    ns = Namespace(eng.namespace.model_fingerprint, layout_id(eng.kv), CFG.block_size, name="test")
    with BlockStore(StoreConfig(str(tmp_path / "store"))) as store:
        store.register_namespace(ns)
        layout = block_layout(eng.kv)
        payloads = [encode_block(eng.kv, b) for b in req.block_ids[:3]]
        store.put_many([PutItem(k, p, ns.id, layout) for k, p in zip(req.block_keys, payloads)])
        spare = eng.pool.allocate(3)
        for b, k in zip(spare, req.block_keys):
            decode_block(eng.kv, b, store.get(k))
        for (src, dst) in zip(req.block_ids[:3], spare):
            assert all(torch.equal(t[src], t[dst]) for t in eng.kv.lanes.values())
        eng.pool.release(spare)
        with pytest.raises(ValueError, match="does not fit"):
            decode_block(eng.kv, spare[0], b"short")
    eng.abort(req.request_id)
    eng.check_idle()


@torch.no_grad()
def test_exact_warm_start_from_stored_blocks_and_a_tail_snapshot(model, tmp_path):
    """Cold run of P + Q vs: run P, store its blocks and tail snapshot, then a new engine loads them
    into fresh pool blocks and continues with Q: the same greedy tokens (exact mode)."""
    from kvcache.engine.cache.block_payload import decode_block, encode_block
    from kvcache.engine.cache.snapshot import capture, restore
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(21)
    P = torch.randint(3, 380, (2 * CFG.block_size,), generator=g).tolist()
    Q = torch.randint(3, 380, (11,), generator=g).tolist()
    cold = tokens(LLM(model=model, config=CFG).generate([P + Q], greedy))[0][0]

    first = LLM(model=model, config=CFG).engine
    a = first.add_request(P, greedy)
    while a.num_computed < len(P):
        first.step()
    stored = {k: encode_block(first.kv, b) for k, b in zip(a.block_keys, a.block_ids)}
    snap = capture(a.state)
    first.abort(a.request_id)

    warm = LLM(model=model, config=CFG).engine
    b = warm.add_request(P + Q, greedy)
    b.block_ids += warm.pool.allocate(len(stored))          # the prefix's blocks, loaded from the store
    for bid, key in zip(b.block_ids, a.block_keys):
        decode_block(warm.kv, bid, stored[key])
    b.state = restore(model, warm._view(b), snap)
    b.num_computed = len(P)
    while warm.has_work():
        warm.step()
    assert b.output == cold and b.metrics.tokens_computed == len(Q) + 7      # P was never recomputed
    warm.check_idle()
