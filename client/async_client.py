"""Clients of the `kvcache serve` daemon (docs/api.md): `AsyncKVClient` here, the blocking `KVClient`
in sync_client.py; both keep kvstore/protocol.py's contract (`AsyncStore`, `Store`).

Contract:
  * `KVClient` has the method names and semantics of `BlockStore` (register_namespace, lookup,
    contains, get, get_into, get_many, get_many_into, put, put_many, pin, unpin, delete, stats,
    close, context manager; stats() rebuilds the daemon's StoreStats), so the engine can use
    either (see `open_store`). Differences:
    the tenant comes from the bearer token (a non-empty `tenant` is refused); there is no
    flush() (the daemon owns durability); batches larger than the daemon's limits are split,
    so a put_many that fails part-way may have stored its earlier chunks (layouts, TTLs and
    key sizes are checked client-side first, so that needs an unknown namespace or a daemon fault).
  * Errors map onto kvstore/errors.py: 400/413 -> BlockFormatError, 422 -> UnknownNamespaceError,
    401/403 -> AuthError, 507 -> TierFullError (its subclass QuotaExceededError for a tenant's
    quota), 429 `too_many_namespaces` -> NamespaceLimitError, no answer after the retries
    (not running, refused, reset, timed out) -> DaemonUnreachableError (a DaemonError and a
    StoreUnavailableError), anything else (5xx, bad stream) -> DaemonError. Each carries
    `.status` and `.code` (the JSON `error` field) when the daemon answered.
  * Retries (exponential backoff with jitter) on 502/503/504, connection errors, timeouts and
    truncated streams, for idempotent calls only: reads, lookup/exists, pin/unpin,
    register_namespace and puts. Puts are idempotent because blocks are content-addressed:
    re-sending a block stores nothing new (it counts as already_present); the only visible
    effect of a retried put is that `stored` may undercount what the first attempt wrote.
    Caveat: a hard pin or unpin retried after a lost reply may count twice (soft pins are
    idempotent). delete and gc are never retried.
  * Same host: reads go through the daemon's shared-memory arena when it can be mapped
    (`shared_memory="auto"`, the default; "on" raises if it cannot, "off" never tries):
    the socket carries only keys and leases, the payload is one memcpy (client/shm_client.py).
  * Timeouts: `timeout_s` bounds each small JSON/single-block request; for streamed batches it
    is an inactivity limit per socket read (a large batch may take longer in total).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
from typing import Any, Awaitable, Callable, Sequence

import aiohttp

from kvcache.client.async_wire import error_for, layout_json, put_body, read_get_frames, read_into
from kvcache.client.common import (  # noqa: F401  (the errors are re-exported: public API)
    RETRY_STATUS, AuthError, DaemonError, DaemonUnreachableError, QuotaExceededError, _check_item, _chunks,
    _split_puts, _tier, put_total)
from kvcache.client.shm_client import ArenaUnavailable, LocalArena, ShmControl, attach_shared, read_shared
from kvcache.kvstore.errors import StoreError
from kvcache.kvstore.hashing import Namespace
from kvcache.kvstore.shm_wire import ShmProtocolError
from kvcache.kvstore.types import (LookupResult, PutItem, PutResult, Scatter, StoreStats, Tier, TierStats,
                                   copy_into, dest_pieces)

log = logging.getLogger(__name__)
_RETRYABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError,
              asyncio.IncompleteReadError)


class AsyncKVClient:
    """asyncio client of one daemon; one pooled aiohttp session, created on first use."""
    reads_scatter = True      # get_into / get_many_into take a Scatter (kvstore/types.py)

    def __init__(self, base_url: str = "http://127.0.0.1:8790", token: str | None = None, *,
                 unix_socket: str | None = None, timeout_s: float = 30.0, connect_timeout_s: float = 5.0,
                 retries: int = 3, backoff_s: float = 0.05, max_backoff_s: float = 2.0,
                 pool_size: int = 32, max_batch_blocks: int = 4096, max_batch_bytes: int = 256 << 20,
                 max_keys: int = 100_000, shared_memory: str = "auto", client_name: str = ""):
        if shared_memory not in ("auto", "on", "off"):
            raise ValueError(f"shared_memory must be auto, on or off, got {shared_memory!r}")
        self.shared_memory = shared_memory
        self._arena: LocalArena | None = None
        self._arena_tried, self._lease_s = False, 0.0
        self._directory: tuple | None = None   # (its mapping, DirectoryReader): reads without a lease
        self._control: ShmControl | None = None
        self.control_path = ""          # the daemon's shm control socket, once attached
        self.base_url = base_url.rstrip("/")
        token = token if token is not None else os.environ.get("KVCACHE_TOKEN")
        self._token = token or ""       # the shared-memory handshake's too (KVCACHE_TOKEN included)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        if client_name:                 # labels this client's traffic in the daemon's metrics (server/metrics.py)
            self._headers["X-KVCache-Client"] = client_name
        self.client_name = client_name
        # the shared-memory HELLO's body: the token, then the client's name after a newline
        self._hello = self._token + (f"\n{client_name}" if client_name else "")
        self.unix_socket, self.pool_size = unix_socket, pool_size
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        self.max_batch_blocks, self.max_batch_bytes, self.max_keys = max_batch_blocks, max_batch_bytes, max_keys
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self._stream_timeout = aiohttp.ClientTimeout(sock_connect=connect_timeout_s, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._bulk_session: aiohttp.ClientSession | None = None

    def _get_session(self, bulk: bool = False) -> aiohttp.ClientSession:
        """Bulk uploads get connections of their own: the daemon serves a connection natively
        (payloads straight into its staging memory) only until it carries another request."""
        s = self._bulk_session if bulk else self._session
        if s is None or s.closed:
            conn = (aiohttp.UnixConnector(path=self.unix_socket, limit=self.pool_size) if self.unix_socket
                    else aiohttp.TCPConnector(limit=self.pool_size))
            s = aiohttp.ClientSession(connector=conn, headers=self._headers)
            if bulk:
                self._bulk_session = s
            else:
                self._session = s
        return s

    async def close(self) -> None:
        await self._drop_arena()
        for s in (self._session, self._bulk_session):
            if s is not None:
                await s.close()
        self._session = self._bulk_session = None

    async def __aenter__(self) -> "AsyncKVClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _backoff(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** attempt) * random.uniform(0.5, 1.0)

    async def _call(self, method: str, path: str, handle: Callable[[aiohttp.ClientResponse], Awaitable[Any]], *,
                    retry: bool = True, json_body: Any = None, body: Callable[[], Any] | None = None,
                    headers: dict | None = None, miss_ok: bool = False, stream: bool = False,
                    bulk: bool = False) -> Any:
        """One request with retries: `handle(resp)` runs on 2xx (and on 404 when `miss_ok`)."""
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                async with self._get_session(bulk).request(
                        method, self.base_url + path, json=json_body, data=body() if body else None,
                        headers=headers, timeout=self._stream_timeout if stream else self._timeout) as resp:
                    if resp.status < 300 or (miss_ok and resp.status == 404):
                        return await handle(resp)
                    err = await error_for(resp)
                    if resp.status not in RETRY_STATUS or last:
                        raise err
            except _RETRYABLE as e:
                if last:
                    raise DaemonUnreachableError(f"{method} {self.base_url}{path} failed after {attempt + 1} "
                                                 f"attempt(s): {type(e).__name__}: {e}") from e
            await asyncio.sleep(self._backoff(attempt))
        raise AssertionError("unreachable")

    async def _json(self, method: str, path: str, payload: Any = None, retry: bool = True) -> Any:
        async def handle(resp):
            return await resp.json(content_type=None)
        return await self._call(method, path, handle, json_body=payload, retry=retry)

    async def _keys_op(self, path: str, keys: Sequence[bytes], field: str, retry: bool = True, **extra) -> int:
        total = 0
        for chunk in _chunks(list(keys), self.max_keys):
            total += (await self._json("POST", path, {"keys": [k.hex() for k in chunk], **extra}, retry))[field]
        return total

    # ------------------------------------------------------------------ the BlockStore surface
    async def healthz(self) -> dict:
        return await self._json("GET", "/healthz")

    async def register_namespace(self, ns: Namespace) -> bytes:
        """As BlockStore's: idempotent, and a new non-empty `ns.name` renames the namespace."""
        d = {k: v for k, v in ns.to_dict().items() if k != "scheme_version"}
        ns_id = bytes.fromhex((await self._json("POST", "/v1/namespaces", d))["id"])
        if ns_id != ns.id:
            raise DaemonError(f"daemon registered namespace {ns_id.hex()}, expected {ns.id.hex()}")
        return ns_id

    async def lookup(self, keys: Sequence[bytes], tenant: str = "", namespace_id: bytes | None = None) -> LookupResult:
        """Longest contiguous run of hits. `tenant` (an event label in BlockStore) is ignored:
        the daemon labels lookups with the token's tenant; `namespace_id` labels the report."""
        tiers: list[Tier] = []
        extra = {"namespace": namespace_id.hex()} if namespace_id else {}
        for chunk in _chunks(list(keys), self.max_keys):
            r = await self._json("POST", "/v1/lookup", {"keys": [k.hex() for k in chunk], **extra})
            tiers += [_tier(t) for t in r["tiers"][: r["num_hits"]]]
            if r["num_hits"] < len(chunk):
                break
        return LookupResult(len(tiers), tuple(tiers))

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for chunk in _chunks(list(keys), self.max_keys):
            out += (await self._json("POST", "/v1/exists", {"keys": [k.hex() for k in chunk]}))["exists"]
        return out

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """BlockStore's name for `exists`: both stores answer it."""
        return await self.exists(keys)

    async def contains(self, key: bytes) -> bool:
        async def handle(resp):
            return resp.status == 200
        return await self._call("HEAD", f"/v1/blocks/{key.hex()}", handle, miss_ok=True)

    async def get(self, key: bytes) -> bytes | None:
        if await self._shared_arena() is not None:
            return (await self.get_many([key]))[0]

        async def handle(resp):
            return None if resp.status == 404 else await resp.read()
        return await self._call("GET", f"/v1/blocks/{key.hex()}", handle, miss_ok=True)

    async def get_into(self, key: bytes, out) -> int | None:
        """Stream the payload straight into `out` (a buffer or a `Scatter`); its length, or None on a miss."""
        if await self._shared_arena() is not None or isinstance(out, Scatter):
            return (await self.get_many_into([key], [out]))[0]
        dst = memoryview(out).cast("B")

        async def handle(resp):
            if resp.status == 404:
                return None
            if resp.content_length is not None and resp.content_length > dst.nbytes:
                raise ValueError(f"output buffer holds {dst.nbytes} bytes, block has {resp.content_length}")
            n = 0
            async for chunk in resp.content.iter_any():
                if n + len(chunk) > dst.nbytes:
                    raise ValueError(f"output buffer holds {dst.nbytes} bytes, block is larger")
                dst[n:n + len(chunk)] = chunk
                n += len(chunk)
            return n
        return await self._call("GET", f"/v1/blocks/{key.hex()}", handle, miss_ok=True, stream=True)

    async def _batch_get(self, keys: Sequence[bytes], take) -> list:
        """POST batch_get in chunks (async_wire.read_get_frames checks each frame's key).
        `take(i, n, content)` is awaited for every hit: it must consume exactly the n payload
        bytes from `content` (the response stream); what it returns is hit i's result. A chunk's
        results are kept only from the attempt that read it whole, so no result of a failed
        attempt survives (a block half-read then may have gone since)."""
        keys, result = list(keys), [None] * len(keys)
        base = 0
        for chunk in _chunks(keys, self.max_batch_blocks):
            async def handle(resp, chunk=chunk, base=base):
                result[base: base + len(chunk)] = await read_get_frames(
                    resp.content, chunk, lambda i, n, content: take(base + i, n, content))
            await self._call("POST", "/v1/blocks/batch_get", handle, stream=True,
                             json_body={"keys": [k.hex() for k in chunk], "sized": True})   # no chunked copies
            base += len(chunk)
        return result

    async def _shared_arena(self) -> LocalArena | None:
        """The daemon's DRAM arena mapped here, or None (not on this host, not allowed, off)."""
        if self._arena is None and not self._arena_tried and self.shared_memory != "off":
            self._arena_tried = True
            try:
                info = await self._json("GET", "/v1/shm")   # then HELLO hands over the arena's fds
                control, arena, directory = await attach_shared(info, self._hello, self._timeout.total)
                self._arena, self._control, self._directory = arena, control, directory
                self._lease_s = float(info["lease_s"])
                self.control_path = info["control_socket"]
            except (ArenaUnavailable, StoreError) as e:
                if self.shared_memory == "on":
                    raise DaemonError(f"shared_memory='on' but the daemon's arena cannot be used: {e}") from e
                log.info("kvcache client: reading over the socket, not shared memory: %s", e)
        return self._arena

    async def _read_many(self, keys: Sequence[bytes], from_arena, from_socket) -> list:
        """Shared memory first when mapped; what it cannot serve goes over the socket."""
        keys, result = list(keys), [None] * len(keys)
        arena = await self._shared_arena() if keys else None
        rest = list(range(len(keys)))
        if arena is not None:
            try:
                got, rest = await read_shared(self._control, arena, self.directory, keys, self.max_batch_blocks,
                                              from_arena, self._lease_s)
            except (OSError, asyncio.IncompleteReadError, ShmProtocolError) as e:   # degrade, never fail
                log.warning("kvcache client: shared-memory read failed (%s); reading over HTTP", e)
                await self._drop_arena(arena)
                got = {}
            for i, v in got.items():
                result[i] = v
        if rest:
            for i, v in zip(rest, await from_socket([keys[i] for i in rest], rest)):
                result[i] = v
        return result

    async def _drop_arena(self, stale: LocalArena | None = None) -> None:
        """Disconnect and forget the mappings; the next read tries to attach again. With `stale`,
        only if that is still the attachment (a read that failed on an old one must not drop the
        one another read made since). The mappings are not unmapped here: a read running
        concurrently (another task, or the blocking client's thread) may still be copying out of
        them; each is unmapped when its last reference goes."""
        if stale is not None and self._arena is not stale:
            return
        control = self._control
        self._arena, self._control, self._directory, self._arena_tried = None, None, None, False
        if control is not None:
            await control.close()

    @property
    def directory(self):
        """The daemon's read directory mapped here (kvstore/shm_directory.py), or None."""
        return self._directory[1] if self._directory is not None else None

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        async def over_socket(sub, idx):
            async def take(i, n, content):
                return await content.readexactly(n)
            return await self._batch_get(sub, take)
        return await self._read_many(keys, lambda i, view: bytes(view), over_socket)

    async def get_many_into(self, keys: Sequence[bytes], outs: Sequence) -> list[int | None]:
        """Batched get_into: each payload is copied from the socket's chunks straight into its
        buffer (no whole-payload intermediate). A too-small buffer raises ValueError when its frame
        arrives (earlier buffers may already be filled; BlockStore checks all sizes first)."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")

        def copy(i, view):
            return copy_into(outs[i], view)

        async def over_socket(sub, idx):
            async def take(i, n, content):
                for piece in dest_pieces(outs[idx[i]], n):
                    await read_into(content, piece, piece.nbytes)
                return n
            return await self._batch_get(sub, take)
        return await self._read_many(keys, copy, over_socket)

    async def put(self, key: bytes, payload, namespace_id: bytes, layout=None, tenant: str = "",
                  ttl_s: float | None = None) -> PutResult:
        _check_item(PutItem(key, payload, namespace_id, layout, tenant, ttl_s))
        headers = {"X-KVCache-Namespace": namespace_id.hex(), "Content-Type": "application/octet-stream"}
        if layout is not None:
            headers["X-KVCache-Layout"] = layout_json(layout)
        if ttl_s is not None:
            headers["X-KVCache-TTL"] = repr(float(ttl_s))
        data = memoryview(payload).cast("B")

        async def handle(resp):
            r = await resp.json(content_type=None)
            return PutResult(r["stored"], r["already_present"], r["durable"], r.get("rejected", 0))
        return await self._call("PUT", f"/v1/blocks/{key.hex()}", handle, body=lambda: data, headers=headers)

    async def put_many(self, items: Sequence[PutItem]) -> PutResult:
        """Streams KVB1 batches of at most max_batch_blocks blocks / max_batch_bytes bytes each."""
        for it in items:
            _check_item(it)
        replies = []
        for chunk in _split_puts(items, self.max_batch_blocks, self.max_batch_bytes):
            length, body = put_body(chunk)
            headers = {"Content-Length": str(length), "Content-Type": "application/octet-stream"}
            replies.append(await self._call("POST", "/v1/blocks/batch_put", lambda resp: resp.json(content_type=None),
                                            body=body, headers=headers, stream=True, bulk=True))
        return put_total(replies)

    async def pin(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        extra = {} if ttl_s is None else {"ttl_s": ttl_s}
        return await self._keys_op("/v1/pin", keys, "changed", **extra)

    async def unpin(self, keys: Sequence[bytes]) -> int:
        return await self._keys_op("/v1/unpin", keys, "changed")

    async def delete(self, keys: Sequence[bytes], tenant: str | None = None) -> int:
        """Admin only: the keys of the token's own tenant, or of `tenant` when named (an admin
        purging another tenant's blocks). Never retried: a lost reply surfaces as DaemonError."""
        extra = {} if tenant is None else {"tenant": tenant}
        return await self._keys_op("/v1/delete", keys, "deleted", retry=False, **extra)

    async def gc(self, max_steps: int = 100) -> dict:
        """Admin only: run bounded GC steps in the daemon; its report. Never retried."""
        return await self._json("POST", "/v1/gc", {"max_steps": max_steps}, retry=False)

    async def stats(self) -> StoreStats:
        """The daemon's StoreStats (as BlockStore.stats() returns); `.to_dict()` for JSON."""
        d = await self._json("GET", "/v1/stats")
        known = {f.name for f in dataclasses.fields(StoreStats)}
        d = {k: v for k, v in d.items() if k in known}
        return StoreStats(**{**d, "tiers": [TierStats(**t) for t in d.get("tiers", [])]})

