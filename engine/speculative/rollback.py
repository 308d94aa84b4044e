"""Rollback: a verify step leaves in a request's state only what its verified tokens wrote.

    before the forward   checkpoint = the bounded lanes copied (snapshot.capture: windows,
                         compressor carries, history row counts, length, Engram ids), and a
                         journal on every lane: the rows the forward feeds it (history.record)
    forward              [committed tokens .., x0, d1 .. dk] written everywhere, drafts too
    after verification   keep(n): n = the chunk's tokens that are verified
        window           the checkpoint's rows + the first n journaled rows, last W-1 of them
        compressors      carry restored, row counts cut back to the checkpoint's, then the first
        (V4 CSA/HCA,     n journaled rows absorbed again: the entries of windows closed by
        indexer, V4.1    verified tokens come out as they did (the same pure function of the
        kv sources)      same rows); an entry that pooled a rejected token is gone, its rows are
                         overwritten by the next step
        history rows     in pool blocks past the count: overwritten before they are read
        length, Engram   checkpoint + n tokens
    all drafts accepted: commit() just drops the journals.

No rejected token reaches a compressed entry, an index key, a carry or a window, and nothing
is recomputed through the model: the replay is the lanes' own pooling over rows already made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.engine.cache import snapshot
from kvcache.engine.layers.kv_source import SourceState


@dataclass
class Checkpoint:
    snap: dict                 # snapshot.capture of the state before the step
    lanes: list                # every lane given a journal


def begin(state) -> Checkpoint:
    """Checkpoint a request's state before a verify step and start its journals."""
    lanes = []
    for st in state.layers:
        for lane in (st, st.compressor, st.index):
            if lane is not None:
                lane.journal = []
                lanes.append(lane)
    return Checkpoint(snapshot.capture(state, drafter=False), lanes)


def commit(cp: Checkpoint) -> None:
    """Every token the step wrote is verified: the state stands as it is."""
    for lane in cp.lanes:
        lane.journal = None


def keep(model, state, cp: Checkpoint, tokens: list[int]) -> None:
    """Roll the state back to the verified `tokens`: the first len(tokens) of the step's chunk."""
    n = len(tokens)
    try:
        rope = model.rope
        for layer, st, part in zip(model.layers, state.layers, cp.snap["layers"]):
            attn = layer.attn
            _window(attn, st, part["window"], n)
            if isinstance(st.compressor, SourceState):
                _rewind(st.compressor, part["compressor"])
                attn.absorb(_rows(st.compressor, n)[0], st.compressor, rope)
            elif st.compressor is not None:
                _rewind(st.compressor, part["compressor"])
                attn.compressor.absorb(*_rows(st.compressor, n), st.compressor, rope)
            if st.index is not None:
                _rewind(st.index, part["index"])
                attn.indexer.compressor.absorb(*_rows(st.index, n), st.index, rope)
        state.length = cp.snap["length"] + n
        _engram(model, state, cp.snap["extra"], tokens)
    finally:
        commit(cp)


def _rows(lane, n: int) -> tuple[torch.Tensor, ...]:
    """The first n rows the step fed this lane (one journal entry per forward: the chunk's rows),
    with its journal stopped so that the replay is not journaled again."""
    entries, lane.journal = lane.journal, None
    if len(entries) != 1:
        raise RuntimeError(f"a rollback expects one forward's rows per lane, found {len(entries)}")
    return tuple(t[:, :n] for t in entries[0])


def _window(attn, st, before, n: int) -> None:
    (kv,) = _rows(st, n)
    rows = kv if before is None else torch.cat([before.to(kv), kv], 1)
    st.window = rows[:, -(attn.window - 1):] if attn.window > 1 else rows[:, :0]


def _rewind(lane, part: dict) -> None:
    """The lane's carry and counts as they were at the checkpoint (history rows stay in place)."""
    lane.count = part["count"]
    if lane.rows is not None and part["rows"] is not None:
        lane.rows.truncate(part["rows"])
    if getattr(lane, "keys", None) is not None and part["keys"] is not None:
        lane.keys.truncate(part["keys"])
    for name in snapshot.CARRY:
        if name in part:
            value = part[name]
            setattr(lane, name, None if value is None else value.clone())


def _engram(model, state, extra: dict, tokens: list[int]) -> None:
    """V4.1 Engram's last token ids: the checkpoint's, then the verified tokens."""
    if "engram_ids" not in state.extra:
        return
    last = model.config.engram_max_ngram_size - 1
    before = extra.get("engram_ids")
    ids = torch.tensor([tokens], dtype=torch.long)
    full = ids if before is None else torch.cat([before.to(ids), ids], 1)
    state.extra["engram_ids"] = full[:, -last:] if last > 0 else full[:, :0]
