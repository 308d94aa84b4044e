"""One group of a block read (server/batch_get.py): its blocks read into one buffer, laid out as
the bytes that go on the wire.

With the client's keys (a batch_get group) the buffer holds the group's KVB1 frames back to
back, heads written in place around the payloads, so the group goes out in WRITE_SLICE writes
instead of two per block:

    [head 0][payload 0][head 1 (a miss)][head 2][payload 2] ...     one buffer, parts = [it]

A block gone between sizes_tiered and the read (deleted, expired) is a miss, and one stored
again since is what get_many_into read, or a miss if it grew past its slot: their frames no
longer fit that layout, so such a group goes out frame by frame. In a sized stream (its
Content-Length promised from the sizes) every frame must keep its bytes, so such a block is
a padded miss instead, in place: its head rewritten, its slot zeroed. The buffer is reused
(server/read_buffers.py): a payload is cut to what was read into it, and never padded with an
earlier read's bytes. Without the client's keys (GET /v1/blocks/{key}) the parts are the bare
payloads.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from kvcache.kvstore import wire
from kvcache.kvstore.errors import BufferTooSmallError
from kvcache.kvstore.leases import SOCKET, DramLease
from kvcache.kvstore.store import BlockStore
from kvcache.kvstore.types import Tier
from kvcache.server.read_buffers import ReadBuffers


@dataclass(slots=True)
class Group:
    frames: list            # [(payload view or None, tier)], for the metrics and single GETs
    parts: list             # what goes on the wire, in order
    raw: bytearray | None   # the buffer they sit in, for ReadBuffers.give (None: leased chunks)
    lease: DramLease | None = None     # the DRAM chunks the parts view, for release_dram


def group_bytes(sizes, sent: Sequence[bytes] | None) -> int:
    """The buffer a group needs: its payloads, and with `sent` a frame head per key."""
    if sent is None:
        return sum(size[0] for size in sizes if size is not None)
    return sum(wire.frame_bytes(k, size and size[0]) for k, size in zip(sent, sizes))


async def read_group(call: Callable[..., Awaitable], store: BlockStore, buffers: ReadBuffers, keys, sizes,
                     sent: Sequence[bytes] | None = None, sized: bool = False) -> Group:
    """Read `keys` (stored keys, sized `sizes` by sizes_tiered) into one buffer from `buffers`;
    `call` runs a blocking store call in the store's thread pool. `sized`: the frames take
    exactly group_bytes (a block that changed is a padded miss)."""
    heads = [None] * len(sizes) if sent is None else [
        wire.get_frame_head(k, *(size or (None, None))) for k, size in zip(sent, sizes)]
    raw = buffers.take(group_bytes(sizes, sent))
    buf, pos, slots, starts = memoryview(raw), 0, [], []
    for head, size in zip(heads, sizes):
        starts.append(pos)
        if head is not None:
            buf[pos: pos + len(head)] = head
            pos += len(head)
        slots.append(None if size is None else buf[pos: pos + size[0]])
        pos += size[0] if size else 0
    want = [j for j, v in enumerate(slots) if v is not None]
    got = await call(_read_into, store, [keys[j] for j in want], [slots[j] for j in want])
    changed = [(j, n) for j, n in zip(want, got) if n != sizes[j][0]]
    if sized and sent is not None:
        for j, _ in changed:
            _pad(buf, starts[j], sent[j], sizes[j][0])
            slots[j] = None
    else:
        for j, n in changed:
            slots[j] = None if n is None else slots[j][:n]
    frames = [(slots[j], sizes[j][1] if slots[j] is not None else None) for j in range(len(sizes))]
    if sent is None:
        parts = [p for p, _ in frames if p is not None]
    elif changed and not sized:
        parts = [part for k, (payload, tier) in zip(sent, frames) for part in wire.encode_get_frame(k, payload, tier)]
    else:
        parts = [buf[:pos]]
    return Group(frames, parts, raw)


def _pad(buf: memoryview, at: int, key: bytes, nbytes: int) -> None:
    """Turn the frame at `at` into a padded miss of the same length: whatever the read left in
    its slot (part of a block, or a reused buffer's older bytes) becomes zeros."""
    head = wire.padded_miss_head(key, nbytes)
    buf[at: at + len(head)] = head
    start = at + len(head)
    buf[start: start + nbytes] = bytes(nbytes)


async def lease_group(call: Callable[..., Awaitable], store: BlockStore, keys, sizes,
                      sent: Sequence[bytes], sized: bool) -> Group | None:
    """A batch_get group sent from its blocks' DRAM chunks, leased (BlockStore.lease_views; a
    block below DRAM is promoted first): frame heads between views of the arena, no copy into a
    buffer. The caller must release the lease once the socket holds none of the views (or after
    aborting the connection). None, and nothing held, when a live block cannot be placed in DRAM,
    or when the blocks leased hold more bytes than were sized (stored again larger since: the
    budget was charged from the sizes); read_group then reads the group through its buffer.

        parts: [head 0] [arena view 0] [head 1 (a miss)] [head 2] [arena view 2] ...
    """
    views, lease = await leased(call, store, keys)
    if any(v is SOCKET for v in views) or lease.nbytes > group_bytes(sizes, None):
        await release(call, store, lease)
        return None
    parts, frames = [], []
    for key, size, view in zip(sent, sizes, views):
        promised = None if size is None else size[0]
        if view is not None and (not sized or view.nbytes == promised):
            tier = Tier.DRAM if size is None else size[1]
            parts += [wire.get_frame_head(key, view.nbytes, tier), view]
            frames.append((view, tier))
        elif sized and promised is not None:       # sized, then gone or stored again at another size
            parts += [wire.padded_miss_head(key, promised), bytes(promised)]
            frames.append((None, None))
        else:
            parts.append(wire.get_frame_head(key, None, None))
            frames.append((None, None))
    return Group(frames, parts, None, lease)


async def leased(call: Callable[..., Awaitable], store: BlockStore, keys) -> tuple[list, DramLease]:
    """store.lease_views in the pool; a caller cancelled meanwhile still gets the lease released
    once the pool returns it (else its chunks would stay unevictable for good)."""
    fut = asyncio.ensure_future(call(store.lease_views, keys))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(lambda f: f.cancelled() or f.exception() or store.release_dram(f.result()[1]))
        raise


async def release(call: Callable[..., Awaitable], store: BlockStore, lease: DramLease) -> None:
    """store.release_dram in the pool, carried out even if the caller is cancelled meanwhile."""
    await asyncio.shield(call(store.release_dram, lease))


def _read_into(store: BlockStore, keys: list, slots: list) -> list:
    """store.get_many_into; a block grown past its slot since it was sized fails the whole call
    before anything is copied, so the group is read again one block at a time and only that
    block is a miss."""
    try:
        return store.get_many_into(keys, slots)
    except BufferTooSmallError:
        out = []
        for key, slot in zip(keys, slots):
            try:
                out += store.get_many_into([key], [slot])
            except BufferTooSmallError:
                out.append(None)
        return out
