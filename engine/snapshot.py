"""Tail snapshots: the per-request part of the KV state that blocks do not hold (exact mode).

    blocks (engine/kv_blocks.py)     history rows of every full block: content-addressed, shared
    tail snapshot (this file)        per layer: window rows, compressor carry (pending rows, CSA's
                                     last Ca half), how many rows each history lane holds, and the
                                     model-level length and Engram token history

A request that finds a prefix's blocks and that prefix's tail snapshot restores both and continues
exactly where the earlier request stopped: its output is bit-identical to a cold run. Without a
snapshot the window and carry are rebuilt by bounded replay instead (approximate by design).
"""

from __future__ import annotations

import torch

_CARRY = ("buf_kv", "buf_gate", "overlap_kv", "overlap_gate", "pending")


def _clone(t):
    return None if t is None else t.detach().clone()


def _part(comp) -> dict | None:
    if comp is None:
        return None
    out = {"count": comp.count, "rows": None if comp.rows is None else comp.rows.count,
           "keys": None if getattr(comp, "keys", None) is None else comp.keys.count}
    for name in _CARRY:
        if hasattr(type(comp), name):
            out[name] = _clone(getattr(comp, name))
    return out


def capture(state) -> dict:
    """Everything but the history rows of a request's ModelState (tensors copied)."""
    return {"length": state.length,
            "extra": {k: _clone(v) if isinstance(v, torch.Tensor) else v for k, v in state.extra.items()},
            "layers": [{"window": _clone(st.window), "compressor": _part(st.compressor), "index": _part(st.index)}
                       for st in state.layers]}


def _restore_part(comp, snap: dict | None) -> None:
    if comp is None or snap is None:
        return
    comp.count = snap["count"]
    if comp.rows is not None and snap["rows"] is not None:
        comp.rows._count = snap["rows"]
    if getattr(comp, "keys", None) is not None and snap["keys"] is not None:
        comp.keys._count = snap["keys"]
    for name in _CARRY:
        if name in snap:
            setattr(comp, name, _clone(snap[name]))


def restore(model, view, snap: dict):
    """A new ModelState over the request's pool view (whose blocks already hold the history rows)."""
    state = model.new_state(view)
    state.length = snap["length"]
    state.extra = {k: _clone(v) if isinstance(v, torch.Tensor) else v for k, v in snap["extra"].items()}
    for st, part in zip(state.layers, snap["layers"]):
        st.window = _clone(part["window"])
        _restore_part(st.compressor, part["compressor"])
        _restore_part(st.index, part["index"])
    return state
