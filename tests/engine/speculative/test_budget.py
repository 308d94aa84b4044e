"""Confidence-scheduled verification: a pure function of confidences and the step cost."""

import pytest

from kvcache.engine.speculative.budget import StepCost, draft_lengths, survival

FLAT = StepCost((1, 64), (0.010, 0.010))           # weight-bound: more tokens cost nothing
LINEAR = StepCost((1, 2), (0.010, 0.020))          # compute-bound: every token costs a step


def test_survival_is_the_running_product():
    assert survival([0.9, 0.5, 2.0, -1]) == pytest.approx([0.9, 0.45, 0.45, 0.0])


def test_a_free_step_verifies_every_draft_a_costly_one_none():
    conf = {"a": [0.9, 0.8, 0.7], "b": [0.5, 0.5]}
    assert draft_lengths(conf, FLAT, 0, 512) == {"a": 3, "b": 2}
    assert draft_lengths(conf, LINEAR, 0, 512) == {"a": 0, "b": 0}


def test_positions_go_by_falling_survival_across_requests():
    cost = StepCost((2, 3, 4, 5, 6), (1.0, 1.2, 1.55, 2.0, 2.6))
    # a: 0.9, 0.72, 0.36; b: 0.6, 0.3 -> admitted in order 0.9 (a1), 0.72 (a2), 0.6 (b1)...
    got = draft_lengths({"a": [0.9, 0.8, 0.5], "b": [0.6, 0.5]}, cost, 0, 512)
    # rates: 2/1.0=2.0, 2.9/1.2=2.42, 3.62/1.55=2.34 (stop): a verifies 1, b none
    assert got == {"a": 1, "b": 0}


def test_the_first_admission_that_does_not_pay_stops_the_search():
    # a jagged curve (a padded graph size): a 5th token is cheap again, but the search never
    # looks past the 4th, which did not pay; looking would choose on what it cannot yet know
    cost = StepCost((1, 2, 3, 4, 5), (1.0, 1.0, 1.0, 2.0, 1.0))
    assert draft_lengths({"a": [0.9, 0.9, 0.9, 0.9]}, cost, 0, 512) == {"a": 2}


def test_the_token_budget_and_the_steps_other_tokens_bound_it():
    conf = {"a": [0.99] * 6}
    assert draft_lengths(conf, FLAT, 0, 4) == {"a": 3}           # anchor + 3 drafts
    assert draft_lengths(conf, FLAT, 60, 64) == {"a": 3}
    assert draft_lengths(conf, FLAT, 63, 64) == {"a": 0}


def test_step_cost_interpolates_and_extrapolates():
    c = StepCost((4, 8), (1.0, 2.0))
    assert c.at(1) == 1.0 and c.at(6) == pytest.approx(1.5) and c.at(16) == pytest.approx(4.0)
    assert StepCost((2,), (1.0,)).at(4) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        StepCost((4, 2), (1.0, 1.0))
    with pytest.raises(ValueError):
        StepCost((1,), (0.0,))


def test_the_measured_cost_never_falls_with_more_tokens():
    import time
    from kvcache.engine.speculative.decoding import measure_cost

    class Model:          # a step that gets faster past 4 tokens: noise the budget must not trust
        def new_state(self):
            return self

        def clone(self):
            return self

        def step(self, chunks, states):
            pass

        def step_rows(self, chunks, states, tails):
            time.sleep(0.004 if len(chunks[0]) <= 4 else 0.001)

    cost = measure_cost(Model(), 16)
    assert cost.tokens == (1, 2, 4, 8, 16)
    assert list(cost.seconds) == sorted(cost.seconds) and cost.at(16) >= cost.at(4)
