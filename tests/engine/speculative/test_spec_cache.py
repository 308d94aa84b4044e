"""Speculation with prefix-cache hits, both cache modes: greedy answers equal a cold plain run,
and after a hit the drafter holds the context a cold run's drafter holds (exact mode: its windows
come with the tail snapshot; replay mode: the bounded replay feeds them), so it drafts alike."""

import dataclasses

import pytest
import torch

from kvcache.engine.llm import LLM
from tests.engine.prefix_cache_setup import GREEDY, cached, cold, open_store, prompts
from tests.engine.speculative.test_spec_engine import case  # noqa: F401  (the mtp / dspark tiny models)


def _spec(config, method):
    return dataclasses.replace(config, speculative=method, num_draft=3)


@pytest.mark.parametrize("mode", ["exact", "replay"])
def test_hits_keep_greedy_answers_and_the_drafters_context(case, mode, tmp_path):  # noqa: F811
    model, method = case
    P, Qs = prompts(5)
    asks = [P + q for q in Qs]
    want = cold(model, asks)
    store = open_store(tmp_path)
    windows = {}

    def watch(llm):              # the drafter's windows and drafts when it first drafts after the prompt
        propose_all = llm.engine.spec.propose_all

        def watched(reqs):
            propose_all(reqs)
            for req in reqs:
                if len(req.output) == 1:
                    windows[tuple(req.prompt)] = ([None if st.window is None else st.window.clone()
                                                   for st in req.state.drafter], req.proposal.draft.tokens)
        llm.engine.spec.propose_all = watched

    with LLM(model=model, config=_spec(cached(mode), method), store=store) as llm:
        watch(llm)
        got = [llm.generate([a], GREEDY)[0][0] for a in asks]
        assert [o.token_ids for o in got] == want
        assert sum(o.usage.total_cached for o in got[1:]) > 0                 # later questions hit the document
    with LLM(model=model, config=_spec(cached(mode), method)) as fresh:        # no store: cold, same engine kind
        watch(fresh)
        windows.clear()
        for a in asks[1:]:
            fresh.generate([a], GREEDY)
    cold_windows = dict(windows)
    windows.clear()
    with LLM(model=model, config=_spec(cached(mode), method), store=store) as again:   # every ask hits now
        watch(again)
        for a in asks[1:]:
            out = again.generate([a], GREEDY)[0][0]
            assert out.usage.total_cached > 0
    assert windows.keys() == cold_windows.keys() and windows
    for prompt, (hit, drafts) in windows.items():
        ref, cold_drafts = cold_windows[prompt]
        for a, b in zip(hit, ref):
            # exact: the snapshot's own rows; replay rebuilds them as it rebuilds the target's
            # windows, approximately (a window's first rows come from a replayed history)
            tol = 0 if mode == "exact" else 1e-2
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        assert drafts == cold_drafts
