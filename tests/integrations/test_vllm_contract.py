"""The connector's two halves against vLLM's contract, with a fake store seam: what the scheduler
holds is exactly what the workers report, loads that time out never write, the store is asked
once per waiting request. (End to end on vLLM: test_vllm_connector.py.)"""

from __future__ import annotations

import threading
import types

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is the [vllm] extra: pip install -e '.[vllm]'")

from kvcache.kvstore.types import copy_pieces, dest_pieces  # noqa: E402
from kvcache.integrations.vllm.kv_blocks import KVBlocks  # noqa: E402
from kvcache.integrations.vllm.naming import BlockNaming  # noqa: E402
from kvcache.integrations.vllm.scheduler_side import SchedulerSide  # noqa: E402
from kvcache.integrations.vllm.worker_side import WorkerSide  # noqa: E402

BS = 4
NAMING = BlockNaming(model="m", dtype="float32", kv_heads=1, head_size=4, block_size=BS, backend="a", device="cpu")


class FakeSeam:
    """The store seam: a dict; `gate` (an Event) holds gets until set."""

    def __init__(self):
        self.stored, self.lookups, self.gate = {}, 0, None
        self.entered = threading.Event()              # set once a get has started

    def lookup(self, keys):
        self.lookups += 1
        n = 0
        while n < len(keys) and keys[n] in self.stored:
            n += 1
        return ["dram"] * n

    def get_now(self, keys, outs):
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        got = []
        for k, o in zip(keys, outs):
            if k in self.stored:
                data = memoryview(self.stored[k])
                got.append(copy_pieces(dest_pieces(o, data.nbytes), data))
            else:
                got.append(None)
        return got

    def save(self, items, on_done=None):
        self.stored.update((k, bytes(v)) for k, v in items)
        if on_done:
            on_done()

    def flush(self):
        pass


def step(scheduled=None, spec=None, preempted=()):
    n = scheduled or {}
    return types.SimpleNamespace(num_scheduled_tokens=n, scheduled_spec_decode_tokens=spec or {},
                                 preempted_req_ids=set(preempted), total_num_scheduled_tokens=sum(n.values()))


def request(n_tokens, rid="r"):
    ids = list(range(n_tokens))
    return types.SimpleNamespace(request_id=rid, prompt_token_ids=ids, all_token_ids=list(ids),
                                 num_prompt_tokens=n_tokens, num_computed_tokens=0, mm_features=None)


@pytest.fixture
def sides():
    seam, table = FakeSeam(), {}
    sch = SchedulerSide(seam, NAMING, load=True, save=True, block_ids_of=lambda r: table[r])
    kv = KVBlocks({"l0": torch.randn(16, 1, BS, 8), "l1": torch.randn(16, 1, BS, 8)}, 16)
    wk = WorkerSide(seam, kv, 0, load_timeout_s=10)
    yield seam, table, sch, kv, wk
    wk._loader.shutdown(wait=False, cancel_futures=True)


def test_a_held_request_is_reported_once_after_its_last_copy_even_before_wait_for_save(sides):
    seam, table, sch, kv, wk = sides
    req = request(3)
    assert sch.matched_tokens(req, 0) == (0, False)
    table["r"] = [1, 2]
    meta = sch.build(step({"r": 3}))
    assert meta.saves == []                          # no full block computed yet
    wk.start_saves(meta)
    req.num_computed_tokens, req.all_token_ids = 5, list(range(6))   # drafts accepted: block 0 is full
    assert sch.finished(req, [1, 2]) is True
    meta = sch.build(step())
    assert meta.holds == ["r"] and [t.block_ids for t in meta.saves] == [[1]]
    # speculative decoding: vLLM asks get_finished before wait_for_save
    sending, _ = wk.finished({"r"}, meta)
    wk.wait_copies()
    sending2, _ = wk.finished(set(), meta)
    wk.start_saves(meta)                             # the later wait_for_save takes nothing twice
    assert (sending or set()) | (sending2 or set()) == {"r"}
    assert len(seam.stored) == 1
    assert wk.finished(set(), None) == (None, None)


def test_no_hold_while_a_reload_is_in_flight(sides):
    seam, table, sch, kv, wk = sides
    req = request(13)
    sch.matched_tokens(req, 0)
    table["r"] = [1, 2, 3, 4]
    wk.start_saves(sch.build(step({"r": 13})))
    wk.wait_copies()
    req.num_computed_tokens = 0                      # preempted, then claims its own blocks back
    sch.build(step(preempted={"r"}))
    assert sch.matched_tokens(req, 0) == (12, True)
    sch.after_alloc(req, [5, 6, 7, 8], 12)
    meta = sch.build(step())
    assert sch.finished(req, [5, 6, 7, 8]) is False  # aborted while waiting: vLLM holds it for the load
    wk.start_loads(meta)
    done_sending, done_recving = set(), set()
    for _ in range(100):
        s, r = wk.finished({"r"}, sch.build(step()))
        done_sending |= s or set()
        done_recving |= r or set()
        if done_recving:
            break
        threading.Event().wait(0.01)
    assert done_recving == {"r"} and not done_sending


def saved_then_claimed(sch, table, wk) -> None:
    """Request r's blocks 1-3 saved (8 tokens in 2 full blocks), then request q with the same
    prompt claiming them into its blocks 9-11: its load of blocks 9 and 10 comes next step."""
    req = request(9)
    sch.matched_tokens(req, 0)
    table["r"] = [1, 2, 3]
    wk.start_saves(sch.build(step({"r": 9})))
    wk.wait_copies()
    other = request(9, "q")
    assert sch.matched_tokens(other, 0) == (8, True)
    sch.after_alloc(other, [9, 10, 11], 8)


def test_a_load_that_times_out_never_writes(sides):
    seam, table, sch, kv, _ = sides
    now = [0.0]
    wk = WorkerSide(seam, kv, 0, load_timeout_s=1.0, clock=lambda: now[0])
    saved_then_claimed(sch, table, wk)
    before = [v[9:11].clone() for v in kv.views]
    seam.gate = threading.Event()                    # the daemon hangs
    wk.start_loads(sch.build(step()))
    now[0] = 5.0
    _, recving = wk.finished(set())
    assert recving == {"q"} and wk.take_errors() == {9, 10}
    seam.gate.set()                                  # the daemon answers, too late
    wk._loader.submit(lambda: None).result()
    assert all(torch.equal(v[9:11], b) for v, b in zip(kv.views, before))
    assert wk.counters.loaded_blocks == 0


def test_a_direct_load_fills_the_blocks_and_is_not_abandoned_while_it_writes(sides):
    """On the CPU a load reads straight into vLLM's blocks: past its timeout while that read is
    in flight, it is not abandoned (the blocks would go back to vLLM mid-write), and once the
    read returns it is done, without errors."""
    seam, table, sch, kv, _ = sides
    seam.store = types.SimpleNamespace(reads_scatter=True)     # a client that takes a Scatter
    now = [0.0]
    wk = WorkerSide(seam, kv, 0, load_timeout_s=1.0, clock=lambda: now[0])
    assert wk.direct
    saved_then_claimed(sch, table, wk)
    seam.gate = threading.Event()                    # the daemon is slow
    wk.start_loads(sch.build(step()))
    assert seam.entered.wait(10)
    now[0] = 5.0
    assert wk.finished(set()) == (None, None) and wk.counters.abandoned_loads == 0
    seam.gate.set()
    wk._loader.submit(lambda: None).result()
    assert wk.finished(set()) == (None, {"q"}) and wk.take_errors() == set()
    assert all(torch.equal(v[9:11], v[1:3]) for v in kv.views)
    assert wk.counters.loaded_blocks == 2 and wk.counters.scatter_seconds == 0.0
    wk._loader.shutdown(wait=False)


def test_the_store_is_asked_once_while_a_request_waits(sides):
    seam, table, sch, kv, wk = sides
    req = request(13)
    for _ in range(5):
        assert sch.matched_tokens(req, 0) == (0, False)
    assert seam.lookups == 1
    table["r"] = [1, 2, 3, 4]
    sch.build(step({"r": 13}))                       # scheduled: the next ask is a new one
    sch.matched_tokens(req, 0)
    assert seam.lookups == 2
