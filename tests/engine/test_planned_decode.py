"""Planned decode (engine/decode_plan.py, layers/decode_step.py): a pure decode step as tensor ops
gives the general path's tokens, logits and states; every such step takes it; writes land in
the requests' own blocks and slots or in the scratch ones; states it cannot take fall back."""

import dataclasses

import pytest
import torch

from kvcache.engine.llm import LLM
from kvcache.engine.config import EngineConfig
from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from kvcache.engine.sampling import SamplingParams
from tests.engine.tiny import randomize, v4_config

# window 8, compress ratios 4 (CSA, with the indexer) and 16 (HCA), blocks of 16 tokens
CFG = EngineConfig(block_size=16, num_blocks=64, max_tokens_per_step=48, max_running=6, planned_decode=True)
GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return randomize(DeepseekV4ForCausalLM(v4_config(num_nextn_predict_layers=0)), seed=1).eval()


def _prompts():
    """Lengths around the window (8), the ratios (4, 16) and blocks (16): windows that fill up
    while decoding, entries that close in the first steps, a second and a third block."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in (1, 3, 7, 15, 16, 33)]


def _run(model, planned_decode: bool, prompts, params=GREEDY, config=CFG):
    llm = LLM(model=model, config=dataclasses.replace(config, planned_decode=planned_decode))
    seen, planned = {}, []
    llm.engine.logits_hook = lambda req, pos, logits: seen.__setitem__((tuple(req.prompt), req.stream, pos),
                                                                       logits.clone())
    plan = model.plan_decode

    def spy(chunks, states):
        got = plan(chunks, states)
        planned.append((all(len(c) == 1 for c in chunks), got is not None))
        return got
    model.plan_decode = spy
    try:
        outs = llm.generate(prompts, params)
    finally:
        del model.plan_decode
    llm.engine.check_idle()
    return [[c.token_ids for c in o] for o in outs], seen, planned


@torch.no_grad()
def test_planned_decode_matches_the_general_path(model):
    """Every pure decode step takes the plan; greedy tokens equal, logits within fp32 rounding
    (the window's keys sit in slot order with -inf padding: sums in another order)."""
    ps = _prompts()
    tokens, logits, planned = _run(model, True, ps)
    ref_tokens, ref_logits, ref_planned = _run(model, False, ps)
    assert tokens == ref_tokens
    assert logits.keys() == ref_logits.keys()
    for k, ref in ref_logits.items():
        torch.testing.assert_close(logits[k], ref, rtol=1e-5, atol=1e-5)
    decode_steps = [hit for pure, hit in planned if pure]
    assert len(decode_steps) > 20 and all(decode_steps)
    assert not any(hit for pure, hit in ref_planned)                 # planned_decode=False: never


@torch.no_grad()
def test_planned_decode_under_preemption_forks_and_sampling(model):
    """A pool too small for everyone (preemption, recompute), n = 2 (forked slots and a copied
    partial block), seeded sampling: the same tokens as the general path."""
    tight = EngineConfig(block_size=16, num_blocks=9, max_tokens_per_step=32, max_running=5)
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=40, seed=7, n=2, ignore_eos=True)
    ps = _prompts()[1:]
    tokens, _, planned = _run(model, True, ps, params, tight)
    assert tokens == _run(model, False, ps, params, tight)[0]
    assert sum(hit for _, hit in planned) > 10


def _engine_with_state(model, prompt_len: int, decode_steps: int):
    llm = LLM(model=model, config=CFG)
    eng = llm.engine
    g = torch.Generator().manual_seed(5)
    eng.add_request(torch.randint(3, 380, (prompt_len,), generator=g).tolist(),
                    SamplingParams(max_tokens=decode_steps + 50, temperature=0, ignore_eos=True))
    for _ in range(decode_steps + 1):
        eng.step()
    return eng, next(iter(eng.requests.values()))


@torch.no_grad()
def test_writes_land_in_own_blocks_slots_or_scratch(model):
    """Over a decode step, the only lanes rows that change are the request's own blocks and slot,
    and the scratch block and slot."""
    eng, req = _engine_with_state(model, 13, 2)
    before = {k: v.clone() for k, v in (*eng.kv.lanes.items(), *eng.kv.slot_lanes.items())}
    eng.step()
    own_blocks, own_slot = set(req.block_ids) | {eng.kv.scratch_block}, {req.slot, eng.kv.scratch_slot}
    for key, lane in eng.kv.lanes.items():
        changed = {b for b in range(lane.shape[0]) if not torch.equal(lane[b], before[key][b])}
        assert changed <= own_blocks, key
    for key, lane in eng.kv.slot_lanes.items():
        changed = {s for s in range(lane.shape[0]) if not torch.equal(lane[s], before[key][s])}
        assert changed <= own_slot, key
    assert any(not torch.equal(eng.kv.slot_lanes[k][req.slot], before[k][req.slot])
               for k in eng.kv.slot_lanes if k[1] == "window")       # it did write its window


@torch.no_grad()
def test_states_it_cannot_take_fall_back(model):
    """Dense states (a model used without the engine), a window count that disagrees with the
    position, a history write floor above the count: no plan, the general path runs."""
    dense = model.new_state()
    model.forward(torch.tensor([[5, 6, 7]]), dense)
    assert model.plan_decode([torch.tensor([8])], [dense]) is None
    eng, req = _engine_with_state(model, 13, 1)
    chunk = [torch.tensor([req.output[-1]])]
    assert model.plan_decode(chunk, [req.state]) is not None
    csa = next(i for i, blk in enumerate(model.layers) if blk.attn.kind == "csa")
    st = req.state.layers[csa].compressor
    st.floor = st.count + 1
    assert model.plan_decode(chunk, [req.state]) is None
    st.floor = 0
    window = req.state.layers[0].__dict__["_window"]
    window.n -= 1
    assert model.plan_decode(chunk, [req.state]) is None
    window.n += 1
    assert model.plan_decode(chunk, [req.state]) is not None


@torch.no_grad()
def test_padded_steps_give_the_same_logits(model):
    """A step padded to a bucket (what a CUDA graph replays: 8 rows, 4 blocks) gives the real rows'
    logits of the unpadded step, and its padding writes only the scratch block and slot."""
    ps = _prompts()[2:]
    ref_tokens, ref_logits, _ = _run(model, True, ps)
    plan = DeepseekV4ForCausalLM.plan_decode
    model.plan_decode = lambda chunks, states: plan(model, chunks, states, batch=8, blocks=4)
    try:
        llm = LLM(model=model, config=CFG)
        seen = {}
        llm.engine.logits_hook = lambda req, pos, lg: seen.__setitem__((tuple(req.prompt), req.stream, pos), lg.clone())
        tokens = [[c.token_ids for c in o] for o in llm.generate(ps, GREEDY)]
    finally:
        del model.plan_decode
    assert tokens == ref_tokens
    for k, ref in ref_logits.items():
        torch.testing.assert_close(seen[k], ref, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_null_plan_writes_only_the_scratch(model):
    """Every row padding (how a CUDA graph is warmed up before capture): the requests' blocks and
    slots stay as they were."""
    from kvcache.engine.decode_plan import step_views
    eng, req = _engine_with_state(model, 21, 3)
    plan = model.plan_decode([torch.tensor([req.output[-1]])], [req.state], batch=4, blocks=2)
    before = {k: v.clone() for k, v in (*eng.kv.lanes.items(), *eng.kv.slot_lanes.items())}
    null = step_views(plan.null_host(), plan.batch, plan.blocks, plan.ratios)
    model.decode_step(torch.zeros((1, plan.batch), dtype=torch.long), null, plan.lanes)
    for key, lane in (*eng.kv.lanes.items(), *eng.kv.slot_lanes.items()):
        scratch = eng.kv.scratch_block if key in eng.kv.lanes else eng.kv.scratch_slot
        assert torch.equal(lane[:scratch], before[key][:scratch]), key
    assert model.plan_decode([torch.tensor([1])] * 2, [req.state] * 2, batch=1) is None      # over the bucket
    assert model.plan_decode([torch.tensor([1])] * 2, [req.state] * 2) is None               # one slot twice


def test_cuda_graphs_are_refused_where_they_cannot_run(model):
    with pytest.raises(ValueError, match="CUDA device"):
        LLM(model=model, config=dataclasses.replace(CFG, cuda_graphs=True))
    with pytest.raises(ValueError, match="planned_decode"):
        LLM(model=model, config=dataclasses.replace(CFG, cuda_graphs=True, planned_decode=False))
