"""`KVClient`: the blocking client of the daemon, with BlockStore's interface (contract in
client/async_client.py). Most calls run the AsyncKVClient coroutine on a private event loop; the
bulk data paths run in the calling thread instead, where the bytes move with the fewest copies:

    put_many ──────────────> blocking HTTP: sendmsg of frame heads + payload views (blocking_http.py)
    get*  same host ───────> shared-memory arena: one memcpy, placed by the read directory (no
                             round trip) or by a lease round trip on a blocking socket
          otherwise ───────> blocking HTTP: batch_get frames read straight into the caller's buffers

A thread hand-off to the loop costs tens of microseconds and aiohttp copies payloads once more
on each side; at hundreds of 256 KiB blocks per call that is most of the time a call takes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from dataclasses import dataclass
from typing import Sequence

from kvcache.kvstore import wire
from kvcache.client.blocking_http import BlockingHTTP, read_exact, read_exact_into, skip
from kvcache.client.async_client import AsyncKVClient
from kvcache.client.common import DaemonError, _check_item, _chunks, _split_puts, put_pieces, put_total
from kvcache.client.shm_client import ArenaUnavailable, BlockingShmControl, LocalArena, read_shared_blocking
from kvcache.kvstore.shm_directory import DirectoryReader
from kvcache.kvstore.shm_wire import ShmProtocolError
from kvcache.kvstore.hashing import Namespace
from kvcache.kvstore.types import LookupResult, PutItem, PutResult, Scatter, StoreStats, copy_into, dest_pieces

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class _Attachment:
    """One attachment to the daemon's shared memory, taken whole by each read: a read that
    fails drops only the attachment it used (another thread may have made a new one since),
    and the mappings stay valid for reads still copying out of a dropped one."""
    ctl: BlockingShmControl
    arena: LocalArena
    directory: DirectoryReader | None
    lease_s: float


async def _cancel_pending() -> None:
    """Cancel every other task on the loop: calls other threads wait for end, not hang."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class KVClient:
    """Blocking client with BlockStore's interface (kvstore/protocol.py's Store): each small call
    runs its AsyncKVClient coroutine on a private event loop in a daemon thread; put_many and the
    reads run in the calling thread (see the module docstring). Safe to share between threads."""
    reads_scatter = True      # get_into / get_many_into take a Scatter (kvstore/types.py)

    def __init__(self, base_url: str = "http://127.0.0.1:8790", token: str | None = None, **options):
        self._client = c = AsyncKVClient(base_url, token, **options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvcache-client", daemon=True)
        self._thread.start()
        self._closed = self._closing = False
        self._state_lock = threading.Lock()    # submissions to the loop against close()
        self._http = BlockingHTTP(c.base_url, c.unix_socket, c._headers, timeout_s=c._stream_timeout.sock_read,
                                  pool_size=c.pool_size, retries=c.retries, backoff=c._backoff)
        self._att: _Attachment | None = None
        self._shm_tried = False
        self._shm_lock = threading.Lock()

    def _run(self, coro):
        with self._state_lock:
            if self._closed:
                coro.close()
                raise DaemonError("this KVClient is closed")
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            if self._closed:
                raise DaemonError("this KVClient was closed during the call") from None
            raise

    def close(self) -> None:
        """Idempotent, and safe while other threads are mid-call: their loop calls end with
        DaemonError, their shared-memory reads fail over to HTTP (and then find it closed)."""
        with self._state_lock:
            if self._closed or self._closing:
                return
            self._closing = True
        try:
            self._drop_shm()
            self._http.close()
            self._run(self._client.close())
        finally:
            with self._state_lock:
                self._closed = True
            asyncio.run_coroutine_threadsafe(_cancel_pending(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ small calls, on the loop
    def healthz(self) -> dict:
        return self._run(self._client.healthz())

    def register_namespace(self, ns: Namespace) -> bytes:
        """As BlockStore's: idempotent, and a new non-empty `ns.name` renames the namespace."""
        return self._run(self._client.register_namespace(ns))

    def lookup(self, keys: Sequence[bytes], tenant: str = "", namespace_id: bytes | None = None) -> LookupResult:
        """Longest contiguous run of hits; the daemon labels it with the token's tenant."""
        return self._run(self._client.lookup(keys, tenant, namespace_id))

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self._run(self._client.exists(keys))

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """BlockStore's name for `exists`: both stores answer it."""
        return self._run(self._client.exists_many(keys))

    def contains(self, key: bytes) -> bool:
        return self._run(self._client.contains(key))

    def put(self, key: bytes, payload, namespace_id: bytes, layout=None, tenant: str = "",
            ttl_s: float | None = None) -> PutResult:
        """One block in one PUT request (put_many streams batches from this thread)."""
        return self._run(self._client.put(key, payload, namespace_id, layout, tenant, ttl_s))

    def pin(self, keys: Sequence[bytes], ttl_s: float | None = None) -> int:
        return self._run(self._client.pin(keys, ttl_s))

    def unpin(self, keys: Sequence[bytes]) -> int:
        return self._run(self._client.unpin(keys))

    def delete(self, keys: Sequence[bytes], tenant: str | None = None) -> int:
        """Admin only (see AsyncKVClient.delete); never retried."""
        return self._run(self._client.delete(keys, tenant))

    def gc(self, max_steps: int = 100) -> dict:
        """Admin only: bounded GC steps in the daemon; its report. Never retried."""
        return self._run(self._client.gc(max_steps))

    def stats(self) -> StoreStats:
        """The daemon's StoreStats (as BlockStore.stats() returns)."""
        return self._run(self._client.stats())

    # ------------------------------------------------------------------ uploads
    def put_many(self, items: Sequence[PutItem]) -> PutResult:
        """Streams KVB1 batches of at most max_batch_blocks blocks / max_batch_bytes bytes each."""
        self._check_open()
        c = self._client
        for it in items:
            _check_item(it)
        replies = []
        for chunk in _split_puts(items, c.max_batch_blocks, c.max_batch_bytes):
            pieces = put_pieces(chunk)
            headers = {"Content-Length": str(sum(memoryview(p).nbytes for p in pieces)),
                       "Content-Type": "application/octet-stream"}
            replies.append(self._http.request("POST", "/v1/blocks/batch_put", pieces, headers,
                                              lambda resp: json.loads(resp.read())))
        return put_total(replies)

    # ------------------------------------------------------------------ reads
    def get_many_into(self, keys: Sequence[bytes], outs: Sequence) -> list[int | None]:
        """Batched get_into: payloads land straight in the buffers (arena memcpy, or socket readinto);
        a buffer may be a `Scatter` (kvstore/types.py: one payload split over several buffers).
        A too-small buffer raises ValueError (earlier buffers may already be filled)."""
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")

        def copy(i, view):
            return copy_into(outs[i], view)

        def over_socket(idx):
            def take(i, n, resp):
                for piece in dest_pieces(outs[idx[i]], n):
                    read_exact_into(resp, piece)
                return n
            return self._batch_get([keys[i] for i in idx], take)
        return self._read_many(keys, copy, over_socket, lambda i, n: dest_pieces(outs[i], n))

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        def over_socket(idx):
            return self._batch_get([keys[i] for i in idx], lambda i, n, resp: read_exact(resp, n))
        return self._read_many(keys, lambda i, view: bytes(view), over_socket)

    def get(self, key: bytes) -> bytes | None:
        if self._shared() is not None:
            return self.get_many([key])[0]
        return self._run(self._client.get(key))         # one GET, no batch framing

    def get_into(self, key: bytes, out) -> int | None:
        """The payload copied into `out` (a buffer or a `Scatter`); its length, or None on a miss."""
        if self._shared() is not None or isinstance(out, Scatter):
            return self.get_many_into([key], [out])[0]
        return self._run(self._client.get_into(key, out))

    def _read_many(self, keys: Sequence[bytes], from_arena, from_socket, into=None) -> list:
        """Shared memory first when mapped; what it cannot serve goes over HTTP. `into(i, n)`:
        where block i goes, so that blocks only on NVMe can be read from the segment files."""
        self._check_open()
        keys, result = list(keys), [None] * len(keys)
        rest = list(range(len(keys)))
        att = self._shared() if keys else None
        if att is not None:
            try:
                got, rest = read_shared_blocking(att.ctl, att.arena, att.directory, keys, self._client.max_batch_blocks,
                                                 from_arena, att.lease_s, into)
            except (OSError, ShmProtocolError) as e:   # degrade, never fail
                log.warning("kvcache client: shared-memory read failed (%s); reading over HTTP", e)
                self._drop_shm(att)
                got = {}
            for i, v in got.items():
                result[i] = v
        if rest:
            for i, v in zip(rest, from_socket(rest)):
                result[i] = v
        return result

    def _batch_get(self, keys: list[bytes], take) -> list:
        """POST batch_get in chunks; `take(i, n, resp)` reads hit i's n payload bytes from resp
        and returns its result. A retried chunk's last attempt writes every frame's result,
        misses included: nothing from a failed attempt survives (see AsyncKVClient._batch_get)."""
        result: list = [None] * len(keys)
        base, limit = 0, self._client.max_batch_blocks
        for chunk in _chunks(keys, limit):
            # sized: a Content-Length answer, read without http.client's chunked decoding
            body = json.dumps({"keys": [k.hex() for k in chunk], "sized": True}).encode()

            def handle(resp, chunk=chunk, base=base):
                count = wire.parse_stream_header(read_exact(resp, wire.STREAM_HEADER_BYTES), len(chunk))
                if count != len(chunk):
                    raise DaemonError(f"batch_get answered {count} frames for {len(chunk)} keys")
                for i, key in enumerate(chunk):
                    fkey, hit, _tier, n = wire.parse_get_head(read_exact(resp, read_exact(resp, 1)[0] + 10))
                    if fkey != key:
                        raise DaemonError(f"batch_get frame {i} is for key {fkey.hex()}, expected {key.hex()}")
                    if hit:
                        result[base + i] = take(base + i, n, resp)
                    else:
                        skip(resp, n)      # a padded miss's zeros (none for a plain miss)
                        result[base + i] = None
            self._http.request("POST", "/v1/blocks/batch_get", [body],
                               {"Content-Type": "application/json", "Content-Length": str(len(body))}, handle)
            base += len(chunk)
        return result

    def _shared(self) -> _Attachment | None:
        """The shared-memory attachment, made on first use (None: not on this host, or off)."""
        if self._att is not None or self._shm_tried:
            return self._att
        with self._shm_lock:
            if not self._shm_tried:
                self._shm_tried = True
                c = self._client
                arena = self._run(c._shared_arena())
                if arena is not None:
                    directory, lease_s = c.directory, c._lease_s
                    try:
                        ctl = BlockingShmControl.connect(c.control_path, c._hello, c._stream_timeout.sock_read)
                    except ArenaUnavailable as e:
                        if c.shared_memory == "on":
                            raise DaemonError(f"shared_memory='on' but the daemon's arena cannot be used: {e}") from e
                        log.info("kvcache client: reading over the socket, not shared memory: %s", e)
                    else:
                        self._att = _Attachment(ctl, arena, directory, lease_s)
        return self._att

    def _drop_shm(self, stale: _Attachment | None = None) -> None:
        """Disconnect; the next read tries to attach again. With `stale`, only if that is still
        the attachment: a read that failed on an old one leaves a newer one alone."""
        with self._shm_lock:
            att = self._att
            if stale is not None and att is not stale:
                return
            self._att, self._shm_tried = None, False
        if att is not None:
            att.ctl.close()
            if not self._closed:
                self._run(self._client._drop_arena(att.arena))

    def _check_open(self) -> None:
        if self._closed:
            raise DaemonError("this KVClient is closed")
