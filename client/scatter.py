"""A block's destination in pieces: a payload read straight into several buffers, in order.

An engine whose KV cache keeps each layer's blocks in a tensor of its own would otherwise read a
block into one staging buffer and copy each layer's part out of it again (two copies). With a
`Scatter` the client's reads split the payload as they copy it:

    payload   |<- part 0 ->|<- part 1 ->| ... |<- part k ->|
                    |            |                  |
    Scatter   [ layer 0's block, layer 1's block, ..., layer k's block ]    (any writable buffers)

    shared memory   arena slice ─memcpy─> each part
    NVMe file slot  preadv(fd, [header, part 0, ..., part k])  then xxh3 over the parts
    socket          each part read in turn from the response

A payload shorter than the parts fills them from the first on (like a larger buffer); a longer
one raises ValueError, as a too-small buffer does. Only the daemon clients (KVClient,
AsyncKVClient) take a Scatter; BlockStore's readers take single buffers.
"""

from __future__ import annotations

from typing import Sequence

MAX_PARTS = 512          # preadv's iovec limit (IOV_MAX 1024) with room for the record header


class Scatter:
    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: Sequence):
        try:
            views = [memoryview(p).cast("B") for p in parts]
        except TypeError as e:          # not a buffer, or not contiguous
            raise ValueError(f"a Scatter takes contiguous buffers: {e}") from e
        if not views or len(views) > MAX_PARTS:
            raise ValueError(f"a Scatter takes 1 to {MAX_PARTS} buffers, not {len(views)}")
        if any(v.readonly for v in views):
            raise ValueError("a Scatter's buffers must be writable")
        self.parts = views
        self.nbytes = sum(v.nbytes for v in views)

    def pieces(self, n: int) -> list[memoryview]:
        """The first n bytes as views of the parts (ValueError when they hold fewer)."""
        if self.nbytes < n:
            raise ValueError(f"output buffers hold {self.nbytes} bytes, block has {n}")
        out: list[memoryview] = []
        for v in self.parts:
            if n <= 0:
                break
            out.append(v if v.nbytes <= n else v[:n])
            n -= v.nbytes
        return out


def dest_pieces(out, n: int) -> list[memoryview]:
    """Where an n-byte payload goes: one view of a buffer, or a Scatter's pieces."""
    if isinstance(out, Scatter):
        return out.pieces(n)
    dst = memoryview(out).cast("B")
    if dst.nbytes < n:
        raise ValueError(f"output buffer holds {dst.nbytes} bytes, block has {n}")
    return [dst[:n]]


def copy_pieces(pieces: list[memoryview], src: memoryview) -> int:
    """src's bytes into the pieces, in order (their lengths add up to src's); src's length."""
    pos = 0
    for p in pieces:
        p[:] = src[pos: pos + p.nbytes]
        pos += p.nbytes
    return pos
