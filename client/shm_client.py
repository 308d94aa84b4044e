"""The client half of the same-host shared-memory path: map the daemon's DRAM arena read-only
and copy leased blocks out of it (server half and protocol: server/shm_leases.py, docs/api.md).

    client                                   daemon
    GET /v1/shm (HTTP) ──────────────────>  {pid, fd, size, inode, lease_s, control_socket}
    connect control_socket, HELLO token ─>  ok + the arena's fds (SCM_RIGHTS)  (once per client)
    check each fd's inode and size, mmap it read-only                          (once per client)
    LEASE keys ──────────────────────────>  (offset, nbytes) | miss | socket, per key
    memcpy arena[offset:offset+nbytes] -> caller's buffer               (payload never on a socket)
    FORGET lease (no answer awaited)     or RELEASE lease -> valid? (copies that took long)
    later reads of the same blocks: the read directory (kvstore/shm_directory.py) says where they
    are, copy, check the entry did not change; TOUCH keys (no answer) keeps the daemon's books

Mapping fails on another host, in another container or across users (the control socket is not
there or not ours to connect to): the client then reads over the socket (shared_memory="auto")
or raises (shared_memory="on"). The fds are read-only descriptions of sealed memfds: nothing
here could write the daemon's memory even by mistake. The control connection itself:
client/shm_channel.py.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass

from kvcache.kvstore import shm_wire as w
from kvcache.kvstore.hashing import tenant_key
from kvcache.client.shm_channel import (  # noqa: F401  (re-exported: the clients import them from here)
    ArenaUnavailable, BlockingShmControl, LeaseRefused, ShmControl)
from kvcache.client.shm_files import read_record_into
from kvcache.kvstore.shm_wire import FileSlot
from kvcache.kvstore.shm_directory import DIRECT_READS, DirectoryError, DirectoryReader


@dataclass
class LocalArena:
    """A read-only mapping of the daemon's DRAM arena (or of its read directory)."""
    source: str      # for messages: where in the daemon the memory lives
    size: int
    _map: mmap.mmap
    view: memoryview

    @classmethod
    def attach(cls, info: dict, fd: int) -> "LocalArena":
        """Map `fd` (received from the daemon; closed here whatever happens) once its inode and
        size are the ones GET /v1/shm described."""
        source = f"the daemon's memfd (pid {info.get('pid')}, fd {info.get('fd')})"
        try:
            st = os.fstat(fd)
            if st.st_ino != info["inode"] or st.st_size != info["size"]:
                raise ArenaUnavailable(f"the fd received is not {source} (inode {st.st_ino}, {st.st_size} bytes; "
                                       f"expected {info['inode']}, {info['size']}): another daemon's answer?")
            # MAP_POPULATE: map every page now. Otherwise each first read of a 4 KiB page faults,
            # and a 256 KiB block read from a fresh part of the arena cost twice its memcpy.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            try:
                mapping = mmap.mmap(fd, info["size"], flags, mmap.PROT_READ)
            except (OSError, ValueError) as e:   # ENOMEM, a map-count limit, a zero-length file
                raise ArenaUnavailable(f"cannot map {source} ({info['size']} bytes): {e}") from e
        finally:
            os.close(fd)
        return cls(source, info["size"], mapping, memoryview(mapping))

    def slice(self, offset: int, nbytes: int) -> memoryview:
        if not (0 <= offset and nbytes >= 0 and offset + nbytes <= self.size):
            raise ArenaUnavailable(f"the daemon leased bytes {offset}+{nbytes} outside its {self.size}-byte arena")
        return self.view[offset: offset + nbytes]

    def close(self) -> None:
        try:
            self.view.release()
            self._map.close()
        except BufferError:   # a caller's slice (or a directory reader's arrays) is still alive; the GC unmaps it later
            pass


async def attach_shared(info: dict, token: str, timeout_s: float):
    """HELLO, then map what it brought: (ShmControl, the arena, attach_directory's result).
    ArenaUnavailable, with nothing left open, when any of it fails."""
    ctl = await ShmControl.connect(info["control_socket"], token, timeout_s)
    fds, ctl.fds = ctl.fds, []
    try:
        if not fds:
            raise ArenaUnavailable("the daemon accepted HELLO but sent no arena fd (a daemon of another version?)")
        arena = LocalArena.attach(info, fds.pop(0))
    except BaseException:
        w.close_fds(fds)
        await ctl.close()
        raise
    return ctl, arena, attach_directory(info.get("directory"), fds[0] if fds else None)


def attach_directory(info: dict | None, fd: int | None) -> tuple[LocalArena, DirectoryReader] | None:
    """Map the daemon's read directory from `fd` (closed here), or None (no table, not x86, or a
    layout we do not know: every read then leases, which is correct, only slower)."""
    if not info or not DIRECT_READS or fd is None:
        if fd is not None:
            os.close(fd)
        return None
    try:
        table = LocalArena.attach(info, fd)
    except (OSError, KeyError, TypeError, ValueError):   # ArenaUnavailable, or a malformed description
        return None
    try:
        return table, DirectoryReader(table.view, table._map)
    except DirectoryError:
        table.close()
        return None


def read_direct(directory: DirectoryReader, arena: LocalArena, tenant: str, keys: list[bytes], take):
    """Copy the blocks the read directory knows, with no round trip: ({i: take's result},
    [indices to lease]). A copy whose entry changed meanwhile is thrown away and leased."""
    stored = keys if not tenant else [tenant_key(tenant, k) for k in keys]
    found, rows, seqs, offsets, sizes = directory.find_many(stored, time.time())
    values, view, size = {}, arena.view, arena.size
    for i, offset, nbytes in zip(found, offsets, sizes):
        if offset + nbytes <= size:
            values[i] = take(i, view[offset: offset + nbytes])
    # one check after all the copies: an entry unchanged now was unchanged all along (seqs only grow)
    same = directory.unchanged_many(rows, seqs).tolist()
    got = {i: values[i] for i, ok in zip(found, same) if ok and i in values}
    return got, [i for i in range(len(keys)) if i not in got]


def merge_leased(got: dict, ask: list[int], leased: tuple[dict, list[int]]) -> tuple[dict, list[int]]:
    """Fold a lease read of keys[ask] (indices into `ask`) into the direct reads' results."""
    sub_got, sub_rest = leased
    for j, value in sub_got.items():
        got[ask[j]] = value
    return got, [ask[j] for j in sub_rest]


class LeasedCopies:
    """What a read does with each lease's answer; shared by the async and the blocking driver.

    Validity: the daemon honours a lease for `lease_s` from when it granted it, which is after we
    sent the request. Copies that end within half that time of the send are good without asking
    (CLOCK_MONOTONIC is one clock for the host, and only durations are compared), so the release
    needs no answer and a read costs one round trip. Slower copies wait for the release's answer;
    when the lease had expired they move to the socket list. File slots (client/shm_files.py)
    are verified, not leased: `into(i, n)` gives block i's destination (a list of pieces,
    kvstore/types.py Scatter), and its result is n."""

    def __init__(self, arena: LocalArena, take, lease_s: float, into=None, tenant: str = ""):
        self.arena, self.take, self.lease_s, self.into, self.tenant = arena, take, lease_s, into, tenant
        self.got: dict[int, object] = {}
        self.rest: list[int] = []

    def copy(self, base: int, chunk: list[bytes], slots: list, fds: list[int] = ()) -> list[int]:
        """Call take() for each leased block of one chunk; the indices copied."""
        if len(slots) != len(chunk):
            raise ArenaUnavailable(f"shm lease answered {len(slots)} slots for {len(chunk)} keys")
        done: list[int] = []
        for j, slot in enumerate(slots):
            if slot is None:
                continue
            if slot == "socket":
                self.rest.append(base + j)
            elif isinstance(slot, FileSlot):
                self._read_file(base + j, chunk[j], slot, fds)
            else:
                self.got[base + j] = self.take(base + j, self.arena.slice(slot[0], slot[1]))
                done.append(base + j)
        return done

    def _read_file(self, i: int, key: bytes, slot: FileSlot, fds: list[int]) -> None:
        dst = self.into(i, slot.nbytes) if self.into is not None else [memoryview(bytearray(slot.nbytes))]
        if read_record_into(fds[slot.fd], slot, tenant_key(self.tenant, key), dst):
            self.got[i] = slot.nbytes if self.into is not None else self.take(i, dst[0])
        else:
            self.rest.append(i)      # the daemon's read verifies it again and quarantines a damaged record

    def fresh(self, sent: float) -> bool:
        return time.monotonic() - sent < self.lease_s / 2

    def expired(self, done: list[int]) -> None:
        """The lease ended while we copied: the bytes may be another block's."""
        for i in done:
            del self.got[i]
        self.rest += done

    def result(self) -> tuple[dict, list[int]]:
        return self.got, sorted(self.rest)


async def read_leased(ctl: ShmControl, arena: LocalArena, keys: list[bytes], max_keys: int, take,
                      lease_s: float):
    """Lease `keys` in chunks and call `take(i, view)` for each leased block (`view` is valid only
    during the call). Returns ({i: take's result}, [indices to read over HTTP]); misses are in neither."""
    c = LeasedCopies(arena, take, lease_s)
    for base in range(0, len(keys), max_keys):
        chunk = keys[base: base + max_keys]
        sent = time.monotonic()
        try:
            lease_id, slots = await ctl.lease(chunk)
        except LeaseRefused:
            c.rest += range(base, len(keys))
            break
        try:
            done = c.copy(base, chunk, slots)
        except BaseException:
            ctl.forget(lease_id)
            raise
        if c.fresh(sent):
            ctl.forget(lease_id)
        elif not await ctl.release(lease_id):
            c.expired(done)
    return c.result()


PIPELINE_KEYS = 16    # keys of the first lease on the blocking path; the next is asked for before copying
LATER_KEYS = 64       # keys of each later lease: the first answer comes soon, later ones cost less per key


def read_leased_blocking(ctl: BlockingShmControl, arena: LocalArena, keys: list[bytes], max_keys: int, take,
                         lease_s: float, into=None):
    """read_leased for the blocking client, in the calling thread, with one lease in flight
    ahead: the daemon answers lease k+1 while we copy lease k's blocks (on another core), so
    only the first lease's round trip is waited for. With `into`, leases may answer with file
    slots (LEASE_FILES), read straight into `into(i, n)`.

        client:  LEASE 0 ─ wait ─ LEASE 1 ─ copy 0 ─ FORGET 0 ─ LEASE 2 ─ copy 1 ─ ...
        daemon:                   └─ answer 1 ─┘                └─ answer 2 ─┘
    """
    c = LeasedCopies(arena, take, lease_s, into, ctl.tenant)
    files = into is not None
    bases = _lease_bases(len(keys), max_keys)
    ends = bases[1:] + [len(keys)]
    sent: dict[int, float] = {}

    def ask(i: int) -> None:
        sent[i] = time.monotonic()
        ctl.send_lease(keys[bases[i]: ends[i]], files)

    def drop(reply) -> None:          # a reply we will not copy from: let its lease and fds go
        w.close_fds(reply[2])
        ctl.forget(reply[0])
    with ctl.lock:
        if bases:
            ask(0)
        ahead = None                  # a reply already read off the socket (after a RELEASE)
        for i, base in enumerate(bases):
            try:     # nothing else is in flight here (lease i+1 is asked for below): the channel stays in step
                lease_id, slots, fds = ahead if ahead is not None else ctl.recv_lease(files)
            except LeaseRefused:
                c.rest += range(base, len(keys))
                break
            ahead = None
            in_flight = i + 1 < len(bases)
            if in_flight:
                ask(i + 1)
            try:
                done = c.copy(base, keys[base: ends[i]], slots, fds)
            except BaseException:
                ctl.forget(lease_id)
                if in_flight:         # keep the channel in step: take the reply and let it go
                    drop(ctl.recv_lease(files))
                raise
            finally:
                w.close_fds(fds)
            if c.fresh(sent[i]):
                ctl.forget(lease_id)
                continue
            refused = False
            if in_flight:             # its reply comes before the RELEASE answer
                try:
                    ahead = ctl.recv_lease(files)
                except LeaseRefused:
                    refused = True
            if not ctl.release(lease_id):
                c.expired(done)
            if refused:
                c.rest += range(bases[i + 1], len(keys))
                break
    return c.result()


def _lease_bases(n: int, max_keys: int) -> list[int]:
    """Where each lease of n keys starts: PIPELINE_KEYS first, then LATER_KEYS (at most max_keys).
    Blocks not yet in the read directory are mostly NVMe-only ones, for which the daemon's
    answer costs ~15 us a key plus a fixed part, and the client's read and check of a 64 KiB
    record ~20 us: small leases keep the first wait short, larger ones halve the fixed parts."""
    first, later = max(1, min(max_keys, PIPELINE_KEYS)), max(1, min(max_keys, LATER_KEYS))
    return [0] + list(range(first, n, later)) if n else []


def _direct_first(ctl, directory, arena: LocalArena, keys: list[bytes], take):
    """The directory's reads, then what is left to lease: (got, ask, keys[ask], take for those)."""
    if directory is not None and not ctl.alive():   # a dead daemon's table: the caller reads over HTTP
        raise ConnectionError("the daemon closed the shared-memory control socket")
    got, ask = read_direct(directory, arena, ctl.tenant, keys, take) if directory else ({}, list(range(len(keys))))
    return got, ask, [keys[i] for i in ask], lambda j, view: take(ask[j], view)


def _remapped(into, ask: list[int]):
    return None if into is None else (lambda j, n: into(ask[j], n))


async def read_shared(ctl: ShmControl, arena: LocalArena, directory: DirectoryReader | None, keys: list[bytes],
                      max_keys: int, take, lease_s: float):
    """Read `keys` out of the arena: through the directory where it knows them, leases for the
    rest. Returns ({i: take's result}, [indices to read over HTTP]); misses are in neither."""
    got, ask, sub, sub_take = _direct_first(ctl, directory, arena, keys, take)
    direct = [keys[i] for i in got]
    got, rest = merge_leased(got, ask, await read_leased(ctl, arena, sub, max_keys, sub_take, lease_s)
                             if sub else ({}, []))
    if direct:
        await ctl.touch(direct, max_keys)
    return got, rest


def read_shared_blocking(ctl: BlockingShmControl, arena: LocalArena, directory: DirectoryReader | None,
                         keys: list[bytes], max_keys: int, take, lease_s: float, into=None):
    """read_shared for the blocking client; `into(i, n)`: block i's destination, which lets
    blocks only on NVMe be read from the segment files (client/shm_files.py)."""
    got, ask, sub, sub_take = _direct_first(ctl, directory, arena, keys, take)
    direct = [keys[i] for i in got]
    got, rest = merge_leased(got, ask, read_leased_blocking(ctl, arena, sub, max_keys, sub_take, lease_s,
                                                            _remapped(into, ask))
                             if sub else ({}, []))
    if direct:
        ctl.touch(direct, max_keys)
    return got, rest
