"""A request's cache salt keys its blocks apart: requests with different salts share no prefix, in
the engine's pool or through the store (no hit, so no timing channel between tenants); the same
salt hits; the salt "" keeps today's keys; n > 1 samples and end snapshots inside the first
block chain from the salted root too; a snapshot inside a block carries only its own rows of
that pool block, never those an earlier request (another tenant's) left there."""

import dataclasses

import torch

from kvcache.engine.cache import snapshot
from kvcache.engine.llm import LLM
from kvcache.engine.sampling import SamplingParams
from kvcache.kvstore.hashing import hash_blocks, salted_root
from tests.engine.prefix_cache_setup import CFG, cached, cold, open_store, prompts, serve
from tests.engine.test_engine import model  # noqa: F401  (the v4 / v41 tiny model fixture)

SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)    # the prompt is what is cached


@torch.no_grad()
def test_different_salts_share_no_prefix_in_the_pool_or_the_store(model, tmp_path):
    P, Qs = prompts(51, n_questions=1, doc=48)
    p = P + Qs[0]                                      # 55 tokens: 3 full blocks to hit (a snapshot at 48)
    want = serve(LLM(model=model, config=CFG), p, SHORT).output
    store = open_store(tmp_path)
    with LLM(model=model, config=cached("exact"), store=store) as llm:
        a = serve(llm, p, SHORT, cache_salt="tenant-a")
        b = serve(llm, p, SHORT, cache_salt="tenant-b")       # a's blocks and snapshots sit in the pool
        again = serve(llm, p, SHORT, cache_salt="tenant-a")
    assert [r.output for r in (a, b, again)] == [want] * 3
    assert a.usage.total_cached == 0
    assert b.usage.total_cached == 0, b.usage
    assert again.usage.cached_tokens == {"hbm": 48}, again.usage
    assert not set(a.prompt_keys) & set(b.prompt_keys)
    with LLM(model=model, config=cached("exact"), store=store) as fresh:   # empty pool: only the store
        other = serve(fresh, p, SHORT, cache_salt="tenant-c")
        unsalted = serve(fresh, p, SHORT)
        same = serve(fresh, p, SHORT, cache_salt="tenant-a")
    assert other.usage.total_cached == 0 and other.usage.bytes_loaded == 0, other.usage
    assert unsalted.usage.total_cached == 0, unsalted.usage
    assert same.usage.cached_tokens == {"dram": 48} and same.output == want, same.usage
    store.close()


@torch.no_grad()
def test_the_empty_salt_keeps_todays_keys_and_a_salt_chains_every_block(model):
    llm = LLM(model=model, config=CFG)
    ns = llm.engine.namespace
    P, _ = prompts(52, n_questions=0, doc=40)
    plain = serve(llm, P)
    assert plain.prompt_keys == hash_blocks(ns, P)     # the keys stored caches were written under
    assert plain.block_keys == hash_blocks(ns, plain.tokens)[: len(plain.block_keys)] and len(plain.block_keys) == 3
    salted = serve(llm, P, cache_salt="tenant-a")
    root = salted_root(ns, "tenant-a")
    assert salted.prompt_keys == hash_blocks(ns, P, parent=root) and salted.prompt_keys[0] != plain.prompt_keys[0]
    assert salted.block_keys == hash_blocks(ns, salted.tokens, parent=root)[:3]


@torch.no_grad()
def test_n_samples_inherit_the_salt_for_their_generated_blocks(model):
    """A prompt shorter than a block: every full block is generated, and the first chains from
    the root, which for each sample must be the salted one."""
    llm = LLM(model=model, config=CFG)
    ns, root = llm.engine.namespace, salted_root(llm.engine.namespace, "tenant-a")
    params = SamplingParams(max_tokens=16, temperature=1.0, n=2, seed=5, ignore_eos=True)
    parent = serve(llm, [5, 6, 7, 8, 9], params, cache_salt="tenant-a", cache_points=[3])
    [_, child] = llm.engine.family(parent.request_id)
    assert child.cache_salt == "tenant-a" and child.cache_points == (3,)
    for r in (parent, child):
        assert r.block_keys == hash_blocks(ns, r.tokens[:16], parent=root), r.request_id


@torch.no_grad()
def test_an_end_inside_the_first_block_is_found_only_under_its_salt(model, tmp_path):
    """The end of the model output is a cache point: turn 1 (5 tokens + 10 generated) ends inside
    the first block, where no block key exists to chain its key from; the salted root stands in,
    so turn 2 resumes there under the same salt only (memory, and the store in a new engine)."""
    turn1 = [5, 6, 7, 8, 9]
    store = open_store(tmp_path)
    with LLM(model=model, config=cached("exact"), store=store) as llm:
        first = serve(llm, turn1, cache_salt="tenant-a")
        turn2 = turn1 + first.output + [20, 21, 22]
        want = cold(model, [turn2])[0]
        end = len(turn1) + len(first.output) - 1           # the last answer token was sampled, not computed
        other, plain, same = (serve(llm, turn2, cache_salt=s) for s in ("tenant-b", "", "tenant-a"))
    assert other.usage.total_cached == 0 and plain.usage.total_cached == 0, (other.usage, plain.usage)
    assert same.usage.cached_tokens == {"hbm": end} and same.output == want, same.usage
    with LLM(model=model, config=cached("exact"), store=store) as fresh:
        other, same = (serve(fresh, turn2, cache_salt=s) for s in ("tenant-b", "tenant-a"))
    assert other.usage.total_cached == 0, other.usage
    assert same.usage.cached_tokens == {"dram": end} and same.output == want, same.usage
    store.close()


def _run_keeping_blocks(llm, prompt, **kw):
    """serve(), remembering the block table the request held last (it is emptied when it finishes)."""
    engine, held = llm.engine, []
    req = engine.add_request(prompt, SHORT, **kw)
    while engine.has_work():
        engine.step()
        held = list(req.block_ids) or held
    return req, held


@torch.no_grad()
def test_a_partial_block_snapshot_carries_none_of_an_earlier_tenants_rows(model):
    """Tenant a fills all 4 blocks of the pool; tenant b's request then ends inside its second
    block, a pool block a filled. b's end snapshot holds the rows b's tokens wrote there and zeros
    past them, though the pool block still holds a's rows there; a prompt continuing b's resumes
    from that snapshot exactly."""
    cfg = dataclasses.replace(cached("exact"), num_blocks=4)
    g = torch.Generator().manual_seed(54)
    a_prompt, b_prompt = (torch.randint(3, 380, (n,), generator=g).tolist() for n in (61, 20))
    with LLM(model=model, config=cfg) as llm:
        kv, bs, snaps = llm.engine.kv, cfg.block_size, llm.engine.cache.snapshots
        _, a_blocks = _run_keeping_blocks(llm, a_prompt, cache_salt="a")        # 61 + 3 tokens: 4 blocks
        b, b_blocks = _run_keeping_blocks(llm, b_prompt, cache_salt="b")
        end = len(b.tokens) - 1                            # the last token was sampled, not computed
        k, tail = divmod(end, bs)
        block = b_blocks[k]
        assert k == 1 and tail and block in a_blocks[:3]   # a full block of a's
        data = snaps.memory[snaps.end_key(b, b.block_keys, b.tokens, end)]
        partial, pos, stale = snapshot.decode(data)["partial"], 0, 0
        for name, lane in sorted(kv.lanes.items()):
            n = lane[0].numel() * lane.element_size()
            rows = partial[pos: pos + n].view(lane.dtype).view(lane.shape[1:])
            pos += n
            keep = tail // (bs // lane.shape[1])           # rows of b's tail tokens (one per `ratio` tokens)
            assert torch.equal(rows[:keep], lane[block, :keep]), name
            assert not rows[keep:].any(), name              # zeros, not a's rows
            stale += int(lane[block, keep:].any())
        assert pos == partial.numel() and stale             # a's rows are in the pool block, not the snapshot
        c_prompt = b.tokens + [20, 21, 22]
        c = serve(llm, c_prompt, SHORT, cache_salt="b")
    assert c.usage.cached_tokens == {"hbm": end}, c.usage
    assert c.output == serve(LLM(model=model, config=CFG), c_prompt, SHORT).output
