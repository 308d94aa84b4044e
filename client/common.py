"""What both daemon clients share (AsyncKVClient in async_client.py, KVClient in sync_client.py):
the daemon's errors mapped onto the store's exceptions, and put batches split and encoded as
pieces (frame heads joined, payloads as views of the caller's buffers, never copied).
"""

from __future__ import annotations

import functools
import json
from typing import Sequence

from kvcache.kvstore import wire
from kvcache.kvstore.block_format import check_layout
from kvcache.kvstore.errors import (BlockFormatError, NamespaceLimitError, StoreError, StoreUnavailableError,
                                   TierFullError, UnknownNamespaceError)
from kvcache.kvstore.types import PutResult, Tier
from kvcache.kvstore.types import PutItem

_SMALL = 64 << 10   # frame pieces below this are coalesced into one write
RETRY_STATUS = frozenset({502, 503, 504})


class AuthError(StoreError):
    """The daemon refused the token (401: missing or unknown; 403: not allowed, e.g. not admin)."""

    status: int | None = None
    code: str = ""


class QuotaExceededError(TierFullError):
    """507 `quota_exceeded`: the put would take the token's tenant past its quota_bytes."""


class DaemonError(StoreError):
    """The daemon could not serve the request (5xx, unreachable, malformed reply)."""

    status: int | None = None   # set, with `code`, on every error the daemon answered
    code: str = ""


class DaemonUnreachableError(DaemonError, StoreUnavailableError):
    """No answer from the daemon after the retries: not running, connection refused or reset,
    timed out. Its `status` stays None."""


def error_from(status: int, reason: str, method: str, path: str, raw: bytes) -> StoreError:
    """Map an error response (JSON `{"error", "message"}`) onto the store's exceptions."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        body = {}
    code = body.get("error", "") if isinstance(body, dict) else ""
    msg = body.get("message", "") if isinstance(body, dict) else ""
    text = f"{method} {path}: HTTP {status} {code or reason}: {msg}".rstrip(": ")
    if status in (400, 413):
        err: StoreError = BlockFormatError(text)
    elif status == 422:
        err = UnknownNamespaceError(text)
    elif status in (401, 403):
        err = AuthError(text)
    elif status == 429 and code == "too_many_namespaces":
        err = NamespaceLimitError(text)
    elif status == 507:
        err = QuotaExceededError(text) if code == "quota_exceeded" else TierFullError(text)
    else:
        err = DaemonError(text)
    err.status, err.code = status, code
    return err


@functools.lru_cache(maxsize=64)   # a lookup reply carries one label per block, from a handful of values
def _tier(label: str) -> Tier:
    t = Tier.NONE
    for part in label.split("|"):
        t |= Tier[part.upper()] if part and part != "none" else Tier.NONE
    return t


def _chunks(seq: Sequence, n: int):
    for i in range(0, len(seq), n):
        yield seq[i:i + n]


def _check_item(item: PutItem) -> None:
    if item.tenant:
        raise ValueError("the daemon takes the tenant from the bearer token; leave PutItem.tenant empty")
    if item.ttl_s is not None and not item.ttl_s > 0:
        raise BlockFormatError(f"a block's ttl_s must be positive, got {item.ttl_s}")
    check_layout(item.layout, memoryview(item.payload).nbytes)


def _split_puts(items: Sequence[PutItem], max_blocks: int, max_bytes: int) -> list[list[PutItem]]:
    """Consecutive chunks of at most `max_blocks` items and `max_bytes` payload (at least one item)."""
    out, cur, size = [], [], 0
    for it in items:
        n = memoryview(it.payload).nbytes
        if cur and (len(cur) >= max_blocks or size + n > max_bytes):
            out.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += n
    return out + [cur] if cur else out


def put_total(replies: list[dict]) -> PutResult:
    """One PutResult for the batch_put replies of one put_many (durable only if every chunk was)."""
    return PutResult(sum(r["stored"] for r in replies), sum(r["already_present"] for r in replies),
                     bool(replies) and all(r["durable"] for r in replies), sum(r.get("rejected", 0) for r in replies))


def put_pieces(items: Sequence[PutItem]) -> list[bytes | memoryview]:
    """A KVB1 batch_put body as pieces: small parts joined, payloads as views (never copied)."""
    pieces: list[bytes | memoryview] = []
    small = bytearray(wire.stream_header(len(items)))
    for it in items:
        head, payload = wire.encode_put_frame(
            wire.PutFrame(it.key, it.namespace_id, it.payload, it.layout, it.ttl_s))
        mv = memoryview(payload).cast("B")
        small += head
        if mv.nbytes < _SMALL:
            small += mv
        else:
            pieces += [bytes(small), mv]
            small = bytearray()
    if small:
        pieces.append(bytes(small))
    return pieces
