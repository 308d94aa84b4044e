"""Framing of the shared-memory control channel: a unix socket that carries only keys, offsets
and leases (the payloads are in the shared arena). Little-endian; one request, one reply, in order.

    request:  u32 body_len | u8 op | body
      HELLO    (1)  token (utf-8; empty when the daemon has no auth)
      LEASE    (2)  u32 n | n x (u8 key_len | key)
      RELEASE  (3)  u64 lease_id                       -> reply: u8 valid
      FORGET   (4)  u64 lease_id                       -> no reply (release, answer not wanted)
    reply:    u32 body_len | u8 status (0 ok, else an HTTP-like code) | body (error: utf-8 message)
      HELLO    u8 0
      LEASE    u64 lease_id | u32 n | n x (u8 kind | u64 offset | u64 nbytes)   kind: 0 miss, 1 leased, 2 socket
"""

from __future__ import annotations

import struct

HELLO, LEASE, RELEASE, FORGET = 1, 2, 3, 4
MISS, LEASED, SOCKET = 0, 1, 2
MAX_BODY = 16 << 20
_HEAD = struct.Struct("<IB")
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SLOT = struct.Struct("<BQQ")


class ShmProtocolError(ValueError):
    """A malformed control frame."""


def frame(code: int, body: bytes = b"") -> bytes:
    """A request (code = op) or a reply (code = status)."""
    return _HEAD.pack(len(body), code) + body


def split_head(head: bytes) -> tuple[int, int]:
    n, code = _HEAD.unpack(head)
    if n > MAX_BODY:
        raise ShmProtocolError(f"control frame of {n} bytes exceeds {MAX_BODY}")
    return n, code


HEAD_BYTES = _HEAD.size


def encode_keys(keys) -> bytes:
    parts = [_U32.pack(len(keys))]
    for k in keys:
        if not 1 <= len(k) <= 64:
            raise ShmProtocolError(f"block keys are 1-64 bytes, got {len(k)}")
        parts += [bytes((len(k),)), k]
    return b"".join(parts)


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


def encode_slots(lease_id: int, slots) -> bytes:
    """slots: (offset, nbytes), None (miss) or the string "socket", per key."""
    parts = [_U64.pack(lease_id), _U32.pack(len(slots))]
    for s in slots:
        parts.append(_SLOT.pack(MISS, 0, 0) if s is None else _SLOT.pack(SOCKET, 0, 0) if isinstance(s, str)
                     else _SLOT.pack(LEASED, s[0], s[1]))
    return b"".join(parts)


def decode_slots(body: bytes) -> tuple[int, list]:
    (lease_id,), (n,) = _U64.unpack_from(body), _U32.unpack_from(body, 8)
    if len(body) != 12 + n * _SLOT.size:
        raise ShmProtocolError("LEASE reply has the wrong length")
    out: list = []
    for kind, off, nbytes in _SLOT.iter_unpack(memoryview(body)[12:]):
        out.append((off, nbytes) if kind == LEASED else "socket" if kind == SOCKET else None)
    return lease_id, out


def encode_u64(v: int) -> bytes:
    return _U64.pack(v)


def decode_u64(body: bytes) -> int:
    if len(body) != 8:
        raise ShmProtocolError("expected an 8-byte lease id")
    return _U64.unpack(body)[0]
