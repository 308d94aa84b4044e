"""Rollback: after a verify step keeps n of its tokens, every lane of the request's state (windows,
compressor carries, entries, index keys, Engram ids, length) equals that of a run that only ever
saw those n tokens, and both continue alike. Dense states and pool-backed ones (the engine's)."""

import pytest
import torch

from kvcache.engine.cache import snapshot
from kvcache.engine.kv_pool import KVPool
from kvcache.engine.speculative import rollback
from tests.engine.test_engine import model  # noqa: F401  (the v4 / v41 tiny model fixture)

BLOCK = 16


def _ids(n, seed):
    return torch.randint(3, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class States:
    """New states, dense or in a pool (a table of blocks and a slot each)."""

    def __init__(self, model, pooled: bool):
        self.model = model
        self.pool = KVPool(model, 16, BLOCK, slots=4) if pooled else None
        self.next_block = 0

    def new(self):
        if self.pool is None:
            return self.model.new_state()
        table = list(range(self.next_block, self.next_block + 5))
        self.next_block += 5
        return self.model.new_state(self.pool.view(table, self.pool.acquire_slot()))


def _run(model, state, ids):
    with torch.no_grad():
        return model.step([torch.tensor(ids)], [state])


def _lanes(state) -> dict:
    """Everything a state holds, as tensors: the snapshot's bounded lanes and the history rows."""
    out = {"snap": snapshot.capture(state)}
    for i, st in enumerate(state.layers):
        for name in ("compressor", "index"):
            lane = getattr(st, name)
            if lane is not None and lane.rows is not None:
                out[f"{i}.{name}.rows"] = lane.rows.view()
            if lane is not None and getattr(lane, "keys", None) is not None:
                out[f"{i}.{name}.keys"] = lane.keys.view()
    return out


def _same(a, b, path="state"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert b is not None and a.shape == b.shape, (path, a.shape, getattr(b, "shape", None))
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5, msg=path)
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("pooled", [False, True], ids=["dense", "pool"])
@pytest.mark.parametrize("prompt_len,chunk,keep", [(21, 6, 2), (13, 5, 1), (30, 7, 7), (16, 4, 3)])
def test_keep_leaves_what_the_verified_tokens_wrote(model, pooled, prompt_len, chunk, keep):  # noqa: F811
    states = States(model, pooled)
    prompt, step = _ids(prompt_len, 1), _ids(chunk, 2)
    spec, plain = states.new(), states.new()
    _run(model, spec, prompt)
    _run(model, plain, prompt)
    cp = rollback.begin(spec)
    _run(model, spec, step)                                   # the verify step: every token written
    rollback.keep(model, spec, cp, step[:keep])
    _run(model, plain, step[:keep])                           # a run that only saw the verified tokens
    _same(_lanes(spec), _lanes(plain))
    more = _ids(9, 3)
    torch.testing.assert_close(_run(model, spec, more), _run(model, plain, more), rtol=1e-4, atol=1e-4)
    _same(_lanes(spec), _lanes(plain))


def test_commit_keeps_everything_and_stops_the_journals(model):  # noqa: F811
    states = States(model, True)
    spec, plain = states.new(), states.new()
    for s in (spec, plain):
        _run(model, s, _ids(11, 1))
    cp = rollback.begin(spec)
    _run(model, spec, _ids(5, 2))
    rollback.commit(cp)
    _run(model, plain, _ids(5, 2))
    _same(_lanes(spec), _lanes(plain))
    assert all(lane.journal is None for lane in cp.lanes)
