"""Framing of the shared-memory control channel: a unix socket that carries only keys, offsets
and leases (the payloads are in the shared arena). Little-endian; one request, one reply, in order.

    request:  u32 body_len | u16 op | body
      HELLO    (1)  token (utf-8; empty when the daemon has no auth)
      LEASE    (2)  u32 n | n x (u8 key_len | key)
      RELEASE  (3)  u64 lease_id                       -> reply: u8 valid
      FORGET   (4)  u64 lease_id                       -> no reply (release, answer not wanted)
      TOUCH    (5)  like LEASE's body                  -> no reply (blocks read through the read directory)
      LEASE_FILES (6) like LEASE's body: LEASE, where a block only on NVMe may be answered with
               its record's place in a segment file instead of being promoted first
    reply:    u32 body_len | u16 status (0 ok, else an HTTP status) | body (error: utf-8 message)
      HELLO    the tenant's name (utf-8): directory keys are the tenant's stored keys.
               An accepted HELLO's reply carries file descriptors (SCM_RIGHTS, on its first
               bytes): the DRAM arena, then the read directory when the daemon keeps one. Both
               are read-only descriptions of sealed memfds (tiering/arena.py); a refused HELLO
               carries none. The daemon is not dumpable, so /proc/<pid>/fd is no way in.
      LEASE    u64 lease_id | u32 n | n x u64 offset | n x u64 nbytes | n x u8 kind   kind: 0 miss, 1 leased, 2 socket
               (columns, not records: each column is one array copy to encode and decode)
      LEASE_FILES  LEASE's reply, kinds 3 (file) allowed, then n x u16 header_len | n x u8 fd:
               a file slot's block is the record at `offset` of the fd-th descriptor the reply
               carries (SCM_RIGHTS, read-only, at most MAX_LEASE_FDS): `header_len` header bytes,
               then `nbytes` payload bytes. The client verifies them (kvstore/block_format.py)
               and reads over the socket whatever fails.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from array import array
from typing import NamedTuple

HELLO, LEASE, RELEASE, FORGET, TOUCH, LEASE_FILES = 1, 2, 3, 4, 5, 6
MISS, LEASED, SOCKET, FILE = 0, 1, 2, 3
MAX_BODY = 16 << 20
MAX_FDS = 2                 # the arena and the read directory
MAX_LEASE_FDS = 8           # segment files per LEASE_FILES reply
_HEAD = struct.Struct("<IH")
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class ShmProtocolError(ValueError):
    """A malformed control frame."""


class FileSlot(NamedTuple):
    """A block to read from a segment file: the record at `offset` of the reply's `fd`-th
    descriptor."""
    fd: int
    offset: int
    header_len: int
    nbytes: int


def frame(code: int, body: bytes = b"") -> bytes:
    """A request (code = op) or a reply (code = status)."""
    return _HEAD.pack(len(body), code) + body


def split_head(head: bytes) -> tuple[int, int]:
    n, code = _HEAD.unpack(head)
    if n > MAX_BODY:
        raise ShmProtocolError(f"control frame of {n} bytes exceeds {MAX_BODY}")
    return n, code


HEAD_BYTES = _HEAD.size


def send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send `data` with `fds` attached to its first bytes (the rest, if the kernel took only
    part of it, follows without them)."""
    sent = socket.send_fds(sock, [data], fds) if fds else 0
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_head_with_fds(sock: socket.socket, max_fds: int = MAX_FDS) -> tuple[bytes, list[int]]:
    """A reply's head and the file descriptors that came with it (close-on-exec). Raises
    ShmProtocolError, after closing what arrived, when the kernel had to drop some of them."""
    head, fds = b"", []
    while len(head) < HEAD_BYTES:
        data, got, flags, _ = socket.recv_fds(sock, HEAD_BYTES - len(head), max_fds, socket.MSG_CMSG_CLOEXEC)
        fds += got
        if flags & socket.MSG_CTRUNC or len(fds) > max_fds:
            close_fds(fds)
            raise ShmProtocolError(f"the daemon sent more than {max_fds} file descriptors, or the kernel "
                                   "dropped some (RLIMIT_NOFILE?)")
        if not data:
            close_fds(fds)
            raise ConnectionError("the daemon closed the shared-memory control socket")
        head += data
    return head, fds


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes from `sock` (ConnectionError when the peer closes first)."""
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    while pos < n:
        got = sock.recv_into(view[pos:])
        if not got:
            raise ConnectionError("the peer closed the shared-memory control socket")
        pos += got
    return bytes(buf)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def encode_keys(keys) -> bytes:
    parts = [_U32.pack(len(keys))]
    for k in keys:
        if not 1 <= len(k) <= 64:
            raise ShmProtocolError(f"block keys are 1-64 bytes, got {len(k)}")
        parts += [bytes((len(k),)), k]
    return b"".join(parts)


def touch_frames(keys, max_keys: int) -> bytes:
    """TOUCH requests for `keys`, at most `max_keys` a frame (the daemon's batch limit)."""
    return b"".join(frame(TOUCH, encode_keys(keys[i: i + max_keys])) for i in range(0, len(keys), max_keys))


def decode_keys(body: bytes, max_keys: int) -> list[bytes]:
    if len(body) < 4:
        raise ShmProtocolError("LEASE body is shorter than its key count")
    (n,), pos, keys = _U32.unpack_from(body), 4, []
    if n > max_keys:
        raise ShmProtocolError(f"at most {max_keys} keys per lease, got {n}")
    for _ in range(n):
        if pos >= len(body):
            raise ShmProtocolError("LEASE body ends inside its keys")
        k_len = body[pos]
        key = body[pos + 1: pos + 1 + k_len]
        if not 1 <= k_len <= 64 or len(key) != k_len:
            raise ShmProtocolError("a LEASE key is empty, over 64 bytes or truncated")
        keys.append(key)
        pos += 1 + k_len
    if pos != len(body):
        raise ShmProtocolError("trailing bytes after the LEASE keys")
    return keys


def encode_slots(lease_id: int, slots, files: bool = False) -> bytes:
    """slots: (offset, nbytes), None (miss), the string "socket" or (with `files`, for a
    LEASE_FILES reply) a FileSlot, per key."""
    offsets, sizes, kinds = array("Q"), array("Q"), bytearray(len(slots))
    hlens, fdis = array("H", bytes(2 * len(slots))), bytearray(len(slots))
    for i, s in enumerate(slots):
        if isinstance(s, FileSlot):
            offsets.append(s.offset)
            sizes.append(s.nbytes)
            kinds[i], hlens[i], fdis[i] = FILE, s.header_len, s.fd
        elif isinstance(s, tuple):
            offsets.append(s[0])
            sizes.append(s[1])
            kinds[i] = LEASED
        else:
            offsets.append(0)
            sizes.append(0)
            kinds[i] = MISS if s is None else SOCKET
    if sys.byteorder != "little":
        for col in (offsets, sizes, hlens):
            col.byteswap()
    parts = [_U64.pack(lease_id), _U32.pack(len(slots)), offsets.tobytes(), sizes.tobytes(), kinds]
    return b"".join(parts + ([hlens.tobytes(), fdis] if files else []))


def decode_slots(body: bytes, files: bool = False, nfds: int = 0) -> tuple[int, list]:
    """A LEASE reply (or, with `files`, a LEASE_FILES reply that carried `nfds` descriptors)."""
    (lease_id,), (n,) = _U64.unpack_from(body), _U32.unpack_from(body, 8)
    if len(body) != 12 + (20 if files else 17) * n:
        raise ShmProtocolError("LEASE reply has the wrong length")
    offsets, sizes = array("Q", body[12: 12 + 8 * n]), array("Q", body[12 + 8 * n: 12 + 16 * n])
    hlens = array("H", body[12 + 17 * n: 12 + 19 * n] if files else b"")
    if sys.byteorder != "little":
        for col in (offsets, sizes, hlens):
            col.byteswap()
    kinds, fdis = body[12 + 16 * n: 12 + 17 * n], body[12 + 19 * n:]
    slots: list = []
    for i, (o, z, k) in enumerate(zip(offsets, sizes, kinds)):
        if k == FILE and files:
            if fdis[i] >= nfds:
                raise ShmProtocolError(f"a file slot names descriptor {fdis[i]} of {nfds}")
            slots.append(FileSlot(fdis[i], o, hlens[i], z))
        else:
            slots.append((o, z) if k == LEASED else None if k == MISS else "socket")
    return lease_id, slots


def encode_u64(v: int) -> bytes:
    return _U64.pack(v)


def decode_u64(body: bytes) -> int:
    if len(body) != 8:
        raise ShmProtocolError("expected an 8-byte lease id")
    return _U64.unpack(body)[0]
