"""Cache points (exact mode): a request's prefill chunk ends at each of its points and a snapshot
is saved there, so a later prompt that continues the first p tokens, then differs, resumes exactly
at p (inside a block: from the partial block's rows; on a boundary: from that boundary), from the
engine's memory and from the store; a chat whose next turn re-renders the last answer resumes
each turn where the previous one's prompt stopped being shared."""

import pytest
import torch

from kvcache.engine.llm import LLM
from kvcache.engine.llm_engine import LLMEngine
from tests.engine.prefix_cache_setup import CFG, GREEDY, cached, open_store, serve, tap_logits
from tests.engine.test_engine import model  # noqa: F401  (the v4 / v41 tiny model fixture)

# tokens the random prompts (3..379) never use, standing for a chat template's tags
END_OF_TURN, ASSISTANT, THINK, END_THINK = 380, 381, 382, 383


def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 380, (n,), generator=g).tolist()


def _cold(model, prompt, into: dict | None = None, config=CFG, **kw) -> list[int]:
    """Greedy tokens of `prompt` computed from scratch (`config` without a cache: no hit)."""
    llm = LLM(model=model, config=config)
    if into is not None:
        tap_logits(llm, into, "cold")
    return serve(llm, prompt, **kw).output


@torch.no_grad()
@pytest.mark.parametrize("point", [41, 32])          # inside block 2; on the boundary after block 1
def test_a_prompt_that_continues_the_first_p_tokens_resumes_at_p(model, tmp_path, point):
    """Tokens equal a no-cache engine's. Logits equal, bit for bit, those of a cold run whose
    prefill chunks end where the resumed run's do (at the point, then at 48); a no-cache engine
    chunks at 48 only, which moves fp32 rounding (measured ~1e-6 of the largest logit)."""
    g = torch.Generator().manual_seed(61)
    P = _tokens(g, 70)
    Q, Q2 = (P[:point] + _tokens(g, 20) for _ in range(2))    # Q2 for the store (Q saves its own blocks)
    assert len({Q[point], Q2[point], P[point]}) == 3
    plain_logits, cold_logits, warm_logits = {}, {}, {}
    want = _cold(model, Q, plain_logits)
    assert _cold(model, Q, cold_logits, cached("exact"), cache_points=[point]) == want
    store = open_store(tmp_path)
    with LLM(model=model, config=cached("exact"), store=store) as llm:
        serve(llm, P, cache_points=[point])
        tap_logits(llm, warm_logits, "cold")
        q = serve(llm, Q)
    assert q.usage.cached_tokens == {"hbm": point}, q.usage                # pool blocks + snapshot memory
    assert q.output == want and q.metrics.tokens_computed == len(Q) - point + len(want) - 1
    assert cold_logits.keys() == warm_logits.keys() == plain_logits.keys()
    assert all(torch.equal(cold_logits[k], warm_logits[k]) for k in cold_logits)
    assert max(float((plain_logits[k] - v).abs().max() / v.abs().max()) for k, v in warm_logits.items()) < 1e-5
    with LLM(model=model, config=cached("exact"), store=store) as fresh:   # an empty pool: the store
        q = serve(fresh, Q2)
    assert q.usage.cached_tokens == {"dram": point} and q.output == _cold(model, Q2), q.usage
    store.close()
    with LLM(model=model, config=cached("exact")) as without:              # no point: nothing to resume at
        serve(without, P)
        assert serve(without, Q).usage.total_cached == 0


@torch.no_grad()
def test_chunks_end_at_cache_points_only_in_exact_mode(model):
    g = torch.Generator().manual_seed(62)
    P = _tokens(g, 45)
    for mode, want in (("exact", [5, 30, 45]), ("replay", [45])):    # replay resumes at whole blocks only
        engine = LLMEngine(model, None, cached(mode))
        req = engine.add_request(P, GREEDY, cache_points=[30, 5, 30])
        assert req.cache_points == (5, 30)
        computed = []
        while req.is_prefill:
            engine.step()
            computed.append(req.num_computed)
        assert computed == want, mode


def test_bad_cache_points_are_refused_before_anything_is_queued(model):
    engine = LLMEngine(model, None, cached("exact"))
    for bad in ([0], [10], [-1], [1.5], [True], ["3"], 3):
        with pytest.raises(ValueError, match="cache.point"):
            engine.add_request(list(range(3, 13)), GREEDY, cache_points=bad)
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request(list(range(3, 13)), GREEDY, cache_salt=b"tenant")
    assert not engine.has_work() and not engine.requests


@torch.no_grad()
def test_a_four_turn_chat_resumes_each_turn_at_the_previous_point(model, tmp_path):
    """Each turn's prompt ends with the assistant tag and an open think tag; its point is just
    after the assistant tag. The next turn renders the answer as END_THINK + answer + END_OF_TURN
    where that prompt had THINK, then a new user message: it shares the previous prompt up to the
    point, and no further. Turns 1-3 run on one engine, turn 4 on a new one (from the store)."""
    g = torch.Generator().manual_seed(63)
    prompt = _tokens(g, 37) + [ASSISTANT, THINK]
    store = open_store(tmp_path)
    llm = LLM(model=model, config=cached("exact"), store=store)
    report, point = [], 0
    for turn in range(1, 5):
        if turn == 4:
            llm.close()
            llm = LLM(model=model, config=cached("exact"), store=store)
        req = serve(llm, prompt, cache_points=[len(prompt) - 1])
        hit = req.usage.total_cached
        tiers = {str(t): n for t, n in req.usage.cached_tokens.items()}
        report.append(f"turn {turn}: {hit}/{len(prompt)} prompt tokens cached ({hit / len(prompt):.0%}) {tiers}")
        assert hit >= point, report
        assert req.output == _cold(model, prompt), report
        point = len(prompt) - 1
        prompt = prompt[:point] + [END_THINK] + req.output + [END_OF_TURN] + _tokens(g, 6) + [ASSISTANT, THINK]
    llm.close()
    assert set(req.usage.cached_tokens) == {"dram"}, report                # turn 4: all from the store
    store.close()
