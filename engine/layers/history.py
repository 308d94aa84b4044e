"""Where a request's history rows live (compressed entries, index keys): a growing tensor, or
blocks of the engine's KV pool.

    DenseRows   one tensor per request, grown by concatenation (a model used on its own)
    BlockRows   rows in a pool lane [num_blocks, rows_per_block, dim], addressed through the
                request's block table (the engine): row r sits in block table[r // rows_per_block],
                slot r % rows_per_block, so a block of `block_size` tokens holds exactly the rows its
                tokens produced: what the store saves and loads per block
"""

from __future__ import annotations

import torch


class DenseRows:
    def __init__(self, dim: int, rows: torch.Tensor | None = None, device=None):
        self.dim = dim
        self._rows = rows if rows is not None else torch.zeros((1, 0, dim), device=device or "cpu")

    @property
    def count(self) -> int:
        return self._rows.shape[1]

    def append(self, rows: torch.Tensor) -> None:
        self._rows = torch.cat([self._rows.to(rows.device), rows.float()], 1)

    def view(self) -> torch.Tensor:
        return self._rows

    def clone(self, table=None) -> "DenseRows":
        return DenseRows(self.dim, self._rows.clone())

    def truncate(self, n: int) -> None:
        """Forget rows n.. (a rolled-back speculative step)."""
        self._rows = self._rows[:, :n]


class BlockRows:
    def __init__(self, lane: torch.Tensor, table: list[int], count: int = 0):
        self.lane, self.table, self._count = lane, table, count     # `table` is the request's list (it grows)
        self.per_block, self.dim = lane.shape[1], lane.shape[2]

    @property
    def count(self) -> int:
        return self._count

    def append(self, rows: torch.Tensor) -> None:
        n = rows.shape[1]
        if n == 0:
            return
        last = self._count + n - 1
        if last // self.per_block >= len(self.table):
            raise RuntimeError(f"history row {last} needs block {last // self.per_block} but the request holds "
                               f"{len(self.table)}: the scheduler reserves blocks before the step runs")
        # the rows' flat addresses in the lane, worked out on the host: one copy to the device
        idx = torch.arange(self._count, self._count + n, device="cpu")
        table = torch.tensor(self.table, dtype=torch.long, device="cpu")
        flat = (table[idx // self.per_block] * self.per_block + idx % self.per_block).to(self.lane.device)
        self.lane.view(-1, self.dim)[flat] = rows[0].to(self.lane.dtype)
        self._count += n

    def grow(self, n: int) -> None:
        """Count n rows that a decode graph wrote into the lane itself (layers/decode_step.py)."""
        self._count += n

    def view(self) -> torch.Tensor:
        nb = -(-self._count // self.per_block)
        blocks = self.lane[torch.tensor(self.table[:nb], dtype=torch.long, device=self.lane.device)]
        return blocks.reshape(-1, self.dim)[: self._count][None].float()

    def truncate(self, n: int) -> None:
        """Forget rows n.. (a rolled-back speculative step: the next rows overwrite them)."""
        self._count = min(self._count, n)

    def clone(self, table: list[int] | None = None) -> "BlockRows":
        """The same rows seen through another table (a forked request whose blocks hold a copy)."""
        return BlockRows(self.lane, self.table if table is None else table, self._count)


def padded_rows(rows: list[BlockRows]) -> tuple[torch.Tensor, list[int]]:
    """Several requests' rows in one lane as one tensor [B, N, dim] (fp32) read with one gather,
    and each request's count; rows past a request's count are zeros."""
    first = rows[0]
    pb = first.per_block
    nb = max(-(-r.count // pb) for r in rows)
    table = [r.table[:nb] + [0] * (nb - len(r.table[:nb])) for r in rows]
    blocks = first.lane[torch.tensor(table, dtype=torch.long, device=first.lane.device)]
    out = blocks.reshape(len(rows), nb * pb, first.dim).float()
    counts = [r.count for r in rows]
    if any(c < nb * pb for c in counts):             # another request's (or stale) rows: zeroed
        pad = torch.arange(nb * pb, device=out.device)[None, :] >= torch.tensor(counts, device=out.device)[:, None]
        out = out.masked_fill(pad[..., None], 0.0)
    return out, counts


def make_rows(dim: int, lanes, kind: str, device=None):
    """BlockRows from the pool view `lanes(kind)` when given, else DenseRows (on `device`)."""
    return DenseRows(dim, device=device) if lanes is None else lanes(kind)


class SlotRows:
    """A bounded per-request tensor (a window, a compressor's pending rows) kept in a pool slot:
    rows [0, n) of lane[slot], where lane is [slots, max_rows, width]. Writes copy in; reads are views."""

    def __init__(self, lane: torch.Tensor, slot: int):
        self.lane, self.slot, self.n = lane, slot, 0

    def get(self) -> torch.Tensor:
        return self.lane[self.slot, : self.n][None]

    def set(self, value: torch.Tensor | None) -> None:
        if value is None:
            self.n = 0
            return
        n = value.shape[1]
        if n > self.lane.shape[1]:
            raise ValueError(f"{n} rows do not fit a slot of {self.lane.shape[1]}")
        self.lane[self.slot, :n] = value[0].to(self.lane.dtype)
        self.n = n

    def copy_to(self, slot: int) -> "SlotRows":
        other = SlotRows(self.lane, slot)
        other.set(self.get())
        return other


class SlotField:
    """A state attribute that is a plain tensor, or lives in a SlotRows once one is attached."""

    def __set_name__(self, owner, name: str) -> None:
        self.key = "_" + name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        v = obj.__dict__.get(self.key)
        if isinstance(v, SlotRows):
            return v.get() if v.n else None
        return v

    def __set__(self, obj, value) -> None:
        cur = obj.__dict__.get(self.key)
        if isinstance(cur, SlotRows) and not isinstance(value, SlotRows):
            cur.set(value)
        else:
            obj.__dict__[self.key] = value


def slot_of(obj, name: str) -> SlotRows | None:
    """The SlotRows behind SlotField `name` of obj, or None while it holds a plain tensor (batched
    decode reads and writes many requests' slots with one indexed op per lane)."""
    v = obj.__dict__.get("_" + name)
    return v if isinstance(v, SlotRows) else None


def clone_field(obj, name: str, slot_for):
    """A field's value for a clone: a copy of a tensor, or the slot contents copied to `slot_for(lane)`."""
    v = obj.__dict__.get("_" + name)
    if isinstance(v, SlotRows):
        return v.copy_to(slot_for(v.lane)) if slot_for is not None else v.get().clone() if v.n else None
    return None if v is None else v.clone()


def record(lane, *rows: torch.Tensor) -> None:
    """Keep the rows a step fed into a lane's bounded state when the lane has a journal (a
    speculative step: engine/speculative/rollback.py replays the verified ones)."""
    journal = getattr(lane, "journal", None)
    if journal is not None:
        journal.append(rows)
