"""Tail snapshots: the per-request part of the KV state that blocks do not hold (exact mode).

    blocks (engine/cache/block_payload.py)     history rows of every full block: content-addressed, shared
    tail snapshot (this file)        per layer: window rows, compressor carry (pending rows, CSA's
                                     last Ca half), how many rows each history lane holds, and the
                                     model-level length and Engram token history

A request that finds a prefix's blocks and that prefix's tail snapshot restores both and continues
exactly where the earlier request stopped: its output is bit-identical to a cold run. Without a
snapshot the window and carry are rebuilt by bounded replay instead (approximate by design).
"""

from __future__ import annotations

import torch

CARRY = ("buf_kv", "buf_gate", "overlap_kv", "overlap_gate", "pending")


def _clone(t, device=None):
    """A copy of t (on `device` when given: a snapshot decoded from the store lives on the host)."""
    if t is None:
        return None
    return t.detach().clone() if device is None else t.detach().to(device, copy=True)


def _part(comp) -> dict | None:
    if comp is None:
        return None
    out = {"count": comp.count, "rows": None if comp.rows is None else comp.rows.count,
           "keys": None if getattr(comp, "keys", None) is None else comp.keys.count}
    for name in CARRY:
        if hasattr(type(comp), name):
            out[name] = _clone(getattr(comp, name))
    return out


def capture(state, drafter: bool = True) -> dict:
    """Everything but the history rows of a request's ModelState (tensors copied); with `drafter`,
    the draft layers' windows too (verified context only: a hit then drafts as the cold run did)."""
    snap = {"length": state.length,
            "extra": {k: _clone(v) if isinstance(v, torch.Tensor) else v for k, v in state.extra.items()},
            "layers": [{"window": _clone(st.window), "compressor": _part(st.compressor), "index": _part(st.index)}
                       for st in state.layers]}
    if drafter and state.drafter:
        snap["drafter"] = [_clone(st.window) for st in state.drafter]
        carry = state.draft_carry                  # MTP: the last position's streams, its row still to write
        if carry is not None:
            snap["drafter_carry"] = {"streams": _clone(carry["streams"]), "position": carry["position"]}
    return snap


def _restore_part(comp, snap: dict | None, device) -> None:
    if comp is None or snap is None:
        return
    comp.count = snap["count"]
    if comp.rows is not None and snap["rows"] is not None:
        comp.rows._count = snap["rows"]
    if getattr(comp, "keys", None) is not None and snap["keys"] is not None:
        comp.keys._count = snap["keys"]
    for name in CARRY:
        if name in snap:
            setattr(comp, name, _clone(snap[name], device))


def restore(model, view, snap: dict):
    """A new ModelState over the request's pool view (whose blocks already hold the history rows)."""
    state = model.new_state(view)
    state.length = snap["length"]
    # `extra` (the Engram token history) is host-side state; the layers' tensors go to the model's device
    state.extra = {k: _clone(v, "cpu") if isinstance(v, torch.Tensor) else v for k, v in snap["extra"].items()}
    device = model.embed.weight.device
    for st, part in zip(state.layers, snap["layers"]):
        st.window = _clone(part["window"], device)
        _restore_part(st.compressor, part["compressor"], device)
        _restore_part(st.index, part["index"], device)
    for st, window in zip(state.drafter, snap.get("drafter", ())):
        st.window = _clone(window, device)
    carry = snap.get("drafter_carry")
    if carry is not None:
        state.draft_carry = {"streams": _clone(carry["streams"], device), "position": carry["position"]}
    return state


def at_boundary(model, view, start: int, loaded: int, block_size: int, tokens: list[int]):
    """Where bounded replay starts: a state at `start` with empty windows and carry whose history
    lanes already hold the rows of tokens [0, loaded) (loaded blocks; start <= loaded, both block
    boundaries). Replaying tokens [start, loaded) rebuilds windows and carry; the rows it produces
    below `loaded` are dropped (the write floor), so loaded rows stay exactly as stored. A lane
    holds length / ratio rows (ratio = block_size / the lane's rows per block)."""
    state = model.new_state(view)
    state.length = start
    for st in state.layers:
        for comp in (st.compressor, st.index):
            if comp is None:
                continue
            for rows in (comp.rows, getattr(comp, "keys", None)):
                if rows is not None:
                    rows._count = loaded * rows.per_block // block_size
                    comp.count, comp.floor = start * rows.per_block // block_size, rows._count
    n = getattr(model.config, "engram_max_ngram_size", 0) or 0
    if n > 1 and getattr(model.config, "engram_layer_ids", None):
        state.extra["engram_ids"] = torch.tensor([tokens[max(0, start - (n - 1)): start]], dtype=torch.long,
                                                 device="cpu")
    return state


def misfit(template: dict, snap: dict, length: int) -> str | None:
    """Why `snap` (decoded from the store) cannot be restored into a state shaped like
    `template` (capture of a fresh state) at `length` tokens, or None. restore() zips layers and
    sets what it finds: a snapshot of fewer layers, or of another kind of layer, would resume with
    empty windows and give wrong tokens instead of failing."""
    if not isinstance(snap, dict) or not isinstance(snap.get("layers"), list) \
            or not isinstance(snap.get("extra"), dict):
        return "not a snapshot's structure"
    if snap.get("length") != length:
        return f"snapshot of {snap.get('length')!r} tokens where {length} were expected"
    if len(snap["layers"]) != len(template["layers"]):
        return f"{len(snap['layers'])} layers, the model has {len(template['layers'])}"
    for i, (want, got) in enumerate(zip(template["layers"], snap["layers"])):
        if not isinstance(got, dict) or "window" not in got:
            return f"layer {i} is not shaped like the model's"
        if got["window"] is not None and not isinstance(got["window"], torch.Tensor):
            return f"layer {i}'s window is not a tensor"
        for k in ("compressor", "index"):    # present exactly where the model's layer has one
            if (want[k] is None) != (got.get(k) is None) or not isinstance(got.get(k), (dict, type(None))):
                return f"layer {i}'s {k} is not shaped like the model's"
    drafter = snap.get("drafter", [])        # absent: saved without a drafter (it drafts from later context)
    if not isinstance(drafter, list) or len(drafter) not in (0, len(template.get("drafter", []))) \
            or not all(w is None or isinstance(w, torch.Tensor) for w in drafter):
        return "its drafter windows are not shaped like the model's"
    carry = snap.get("drafter_carry")
    if carry is not None and not (isinstance(carry, dict) and isinstance(carry.get("streams"), torch.Tensor)
                                  and isinstance(carry.get("position"), int) and carry["position"] == length - 1):
        return "its drafter carry is not the streams of its last position"
    return None


# ---------------------------------------------------------------- bytes for the block store
def encode(snap: dict) -> bytes:
    """A snapshot as safetensors bytes (tensors) with its structure as JSON metadata: no pickle,
    so a snapshot read from a shared store can never run code."""
    from safetensors.torch import save
    tensors: dict[str, torch.Tensor] = {}

    def walk(x, path: str):
        if isinstance(x, torch.Tensor):
            tensors[path] = x.contiguous().cpu()
            return {"$t": path}
        if isinstance(x, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(x)]
        return x
    import json
    structure = walk(snap, "s")
    return save(tensors, metadata={"kvcache_snapshot": "1", "structure": json.dumps(structure)})


def decode(data: bytes) -> dict:
    import json
    from safetensors.torch import load
    tensors = load(bytes(data))
    meta = _metadata(data)
    if meta.get("kvcache_snapshot") != "1":
        raise ValueError("not a kvcache tail snapshot")

    def build(x):
        if isinstance(x, dict):
            return tensors[x["$t"]] if set(x) == {"$t"} else {k: build(v) for k, v in x.items()}
        if isinstance(x, list):
            return [build(v) for v in x]
        return x
    return build(json.loads(meta["structure"]))


def _metadata(data: bytes) -> dict:
    import json
    import struct
    (n,) = struct.unpack_from("<Q", data, 0)
    return json.loads(bytes(data[8: 8 + n])).get("__metadata__", {})
