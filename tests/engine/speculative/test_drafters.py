"""MTP's context call that also runs the pending row with the anchor (its first draft) proposes
what the plain path proposes (context, then the pending row in propose), leaving the same window."""

import torch

from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from kvcache.engine.speculative.drafters import MTPDrafter
from tests.engine.tiny import randomize, v4_config


@torch.no_grad()
def test_mtp_first_draft_in_the_context_call_matches_the_plain_path():
    model = randomize(DeepseekV4ForCausalLM(v4_config()), seed=4).eval()
    drafter = MTPDrafter(model)
    ids = torch.randint(3, 380, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    results = []
    for with_anchor in (False, True):
        state = model.new_state()
        _, taps = model.step_rows([torch.tensor(ids[:20])], [state], [20], drafter.collect)
        drafter.context(state, taps, torch.arange(20), ids[:20])                  # a prefill chunk
        _, taps = model.step_rows([torch.tensor(ids[20:24])], [state], [4], drafter.collect)
        drafter.context(state, taps, torch.arange(20, 24), ids[20:24], ids[24] if with_anchor else None)
        assert ("first" in state.draft_carry) == with_anchor
        window = state.drafter[0].window.clone()
        prop = drafter.propose(state, ids[24], 24, 3, lambda logits, pos, d: (int(logits.argmax()), None), True)
        assert torch.equal(state.drafter[0].window, window)                     # proposing left it alone
        results.append((prop.draft.tokens, window))
    (plain, w0), (merged, w1) = results
    assert plain == merged and len(plain) == 3
    torch.testing.assert_close(w0, w1, rtol=1e-5, atol=1e-5)
