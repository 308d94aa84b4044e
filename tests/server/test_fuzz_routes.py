"""Property-based fuzzing of every route of a real daemon (hypothesis): bad input is never a 5xx,
never a traceback at ERROR, and the daemon serves a good request afterwards.

    one daemon per module, in a thread of its own: build_app + the native front (server/front/connection.py)
    on a real listening socket, so batch_put reaches both upload paths:
        Content-Length body   ──> the native path (server/front/bulk_put.py, an upload thread)
        chunked body          ──> aiohttp's batch_put (server/blocks.py)
    each example: one request over a fresh connection (http.client); the reply is checked, then
    the log records the example caused

The daemon's state is reset where an example could change it for the next ones (reconfigure).
Runs are reproducible: derandomized, no example database. FAST examples per route keep the module
within a few tens of seconds; test_every_route_at_length (slow) draws far more across all routes.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import itertools
import json
import logging
import re
import socket
import threading
import urllib.parse

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.server.front.connection import Front
from kvcache.server.front.bulk_put import UPLOAD
from kvcache.server.front.site import FrontSite
from kvcache.server.app import build_app
from kvcache.server.request_state import CONFIG
from kvcache.server.config import ServerConfig, TokenInfo
from kvcache.kvstore import wire
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.hashing import Namespace, hash_blocks
from kvcache.kvstore.store import BlockStore
from kvcache.tiering.config import DramConfig, NvmeConfig

ALICE, ADMIN = "a" * 32, "c" * 32
NS = Namespace("fuzz-model@1", "raw/v1", 16, name="fuzz")
KEYS = hash_blocks(NS, list(range(16 * 4)))
FAST = 25


def fuzz(n: int = FAST):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


class Daemon:
    """The app and the native front on 127.0.0.1, served by an event loop in a thread."""

    def __init__(self, data_dir: str):
        self.store = BlockStore(StoreConfig(data_dir, dram=DramConfig(capacity_bytes=16 << 20, page_bytes=1 << 20,
                                                                      prefault=False, shared_memory=False),
                                            nvme=NvmeConfig(segment_bytes=4 << 20)))
        cfg = ServerConfig(tokens=(TokenInfo(ALICE, "alice"), TokenInfo(ADMIN, "ops", True)),
                           max_block_bytes=1 << 20, max_batch_blocks=64, max_keys=100)
        self.app = build_app(self.store, cfg)
        self.config, self.store_config = self.app[CONFIG].current, self.store.config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = self._run(self._start())

    def _run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> int:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        self.front = Front(self.app, self.runner.server, UPLOAD, read_timeout_s=5)
        site = FrontSite(self.runner, self.front, host="127.0.0.1", port=0)
        await site.start()
        return site.port

    def reset(self) -> None:
        """The settings at start (a fuzzed reconfigure may have changed limits or tokens)."""
        self.app[CONFIG].current, self.store.config = self.config, self.store_config

    def close(self) -> None:
        async def stop():
            await self.front.drain(5)
            await self.runner.cleanup()
        self._run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.store.close()

    def call(self, method: str, path: str, body=None, headers=None, chunked: bool = False) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        try:
            if chunked:
                conn.request(method, path, body=iter([body]) if body else iter([]), headers=headers or {},
                             encode_chunked=True)
            else:
                conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(tmp_path_factory.mktemp("fuzz")))
    status, _ = d.call("POST", "/v1/namespaces", json.dumps(NS.to_dict()).encode(), auth(ALICE))
    assert status == 200
    yield d
    d.close()


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


# ------------------------------------------------------------------ strategies
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) \
    | st.sampled_from([10 ** 400, -(10 ** 400), 2 ** 32, 2 ** 63, 2 ** 64, "1e400", "-1", "nan", "\ud800", "0" * 50])
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=12)
FIELDS = ["keys", "ttl_s", "namespace", "max_steps", "tenant", "server", "store", "dram", "nvme", "object",
          "retention", "namespaces", "tenants", "ttl_hours", "max_age_hours", "enabled", "capacity_bytes",
          "capacity_mib", "tokens", "token", "admin", "quota_bytes", "max_keys", "max_block_bytes",
          *NS.to_dict()]
HEX_KEYS = st.lists(st.sampled_from([k.hex() for k in KEYS]) | st.text("0123456789abcdefXZ", max_size=140),
                    max_size=6)
# objects shaped like the API's, with fuzzed values, so examples pass the first checks and reach deeper ones
SHAPED = st.recursive(st.fixed_dictionaries({}, optional={"keys": HEX_KEYS | JSON, "ttl_s": SCALARS}),
                      lambda c: st.dictionaries(st.sampled_from(FIELDS), c | JSON | HEX_KEYS, max_size=5),
                      max_leaves=10)
SECTION_FIELDS = {"server": ["tokens", "max_block_bytes", "max_batch_blocks", "max_keys", "shm_lease_s", "port",
                              "max_shm_leases", "request_timeout_s", "header_timeout_s", "max_connections"],
                   "store": ["data_dir", "write_policy", "index_map_bytes", "touch_flush_s", "gc_interval_s", "dram"],
                   "dram": ["enabled", "capacity_bytes", "capacity_mib", "page_bytes", "high_watermark", "eviction",
                            "shared_memory", "admission", "admission_memory", "tenants"],
                   "nvme": ["enabled", "capacity_gib", "segment_bytes", "fsync", "fsync_interval_s", "low_watermark"],
                   "object": ["enabled", "url", "codec", "pack_mib", "storage_options", "timeout_s"],
                   "retention": ["ttl_hours", "max_age_hours", "namespaces", "tenants"]}
TOKEN_TABLES = st.lists(st.fixed_dictionaries({}, optional={k: SCALARS for k in (
    "token", "tenant", "admin", "quota_bytes", "shared_memory", "metrics")}), max_size=2)
# a reconfigure body: the config's sections with their own settings, fuzzed values
CONFIGS = st.fixed_dictionaries({}, optional={
    section: st.fixed_dictionaries({}, optional={k: SCALARS | JSON | TOKEN_TABLES for k in keys}) | SCALARS
    for section, keys in SECTION_FIELDS.items()})
DEEP = st.integers(min_value=900, max_value=6000).map(lambda n: "[" * n + "]" * n)
BODIES = st.one_of(JSON.map(json.dumps), SHAPED.map(json.dumps), CONFIGS.map(json.dumps), DEEP,
                   st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                   st.builds(lambda ns: json.dumps({**NS.to_dict(), **ns}),
                             st.dictionaries(st.sampled_from(list(NS.to_dict())), SCALARS, max_size=3)))
HEADER_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=255, blacklist_characters="\x7f"), max_size=60)
LAYOUT_VALUES = st.lists(st.tuples(SCALARS | st.sampled_from(["raw", "k"]), SCALARS | st.sampled_from(["uint8"]),
                                   st.lists(SCALARS | st.integers(0, 10), max_size=3) | SCALARS), max_size=3)
LAYOUTS = st.one_of(HEADER_TEXT, JSON.map(json.dumps), LAYOUT_VALUES.map(json.dumps))
TOKENS = st.sampled_from([ALICE, ADMIN, None, "", "x" * 32, "a" * 31])
PATH_KEYS = st.sampled_from([k.hex() for k in KEYS]) | st.text(max_size=140).map(urllib.parse.quote)


def headers_for(token) -> dict:
    return {} if token is None else {"Authorization": f"Bearer {token}"} if token else {"Authorization": "Basic x"}


# ------------------------------------------------------------------ checks
def check(daemon, caplog, status: int, body: bytes, what, json_reply: bool = True) -> None:
    assert status < 500, (what, status, body[:300])
    if status >= 400 and json_reply:      # the client's mistake: a JSON error that says what to do
        reply = json.loads(body)
        assert set(reply) == {"error", "message"} and reply["message"], (what, reply)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, (what, [(r.name, r.getMessage()[:300]) for r in errors])


GOOD = (hashlib.blake2b(b"good %d" % i, digest_size=16).digest() for i in itertools.count())  # no example's


def still_serves(daemon) -> None:
    daemon.reset()
    key = next(GOOD).hex()
    status, body = daemon.call("PUT", f"/v1/blocks/{key}", key.encode(),
                               {**auth(ALICE), "X-KVCache-Namespace": NS.id.hex()})
    assert status == 200, body
    assert daemon.call("GET", f"/v1/blocks/{key}", headers=auth(ALICE)) == (200, key.encode())


JSON_ROUTES = ["/v1/namespaces", "/v1/lookup", "/v1/exists", "/v1/pin", "/v1/unpin", "/v1/delete", "/v1/gc",
               "/v1/blocks/batch_get", "/v1/admin/reconfigure"]


def json_route(daemon, caplog, path: str, body: str, token, chunked: bool) -> None:
    caplog.clear()                # the records of this example only
    status, reply = daemon.call("POST", path, body.encode("utf-8", "surrogatepass"),
                                {**headers_for(token), "Content-Type": "application/json"}, chunked=chunked)
    daemon.reset()
    if path == "/v1/blocks/batch_get" and status == 200:
        assert reply.startswith(wire.MAGIC), reply[:40]
    check(daemon, caplog, status, reply, (path, body[:200], token))


@pytest.mark.parametrize("path", JSON_ROUTES)
@fuzz()
@given(body=BODIES, token=TOKENS, chunked=st.booleans())
def test_json_routes_answer_bad_bodies_with_4xx(daemon, caplog, path, body, token, chunked):
    json_route(daemon, caplog, path, body, token, chunked)


def block_route(daemon, caplog, method, key, ns, layout, ttl, body, token) -> None:
    caplog.clear()
    headers = headers_for(token)
    for name, value in (("X-KVCache-Namespace", ns), ("X-KVCache-Layout", layout), ("X-KVCache-TTL", ttl)):
        if value is not None:
            headers[name] = value
    status, reply = daemon.call(method, f"/v1/blocks/{key}", body if method == "PUT" else None, headers)
    check(daemon, caplog, status, reply, (method, key, ns, layout, ttl), json_reply=method != "HEAD")


@fuzz(FAST * 2)
@given(method=st.sampled_from(["GET", "HEAD", "PUT"]), key=PATH_KEYS,
       ns=st.none() | st.just(NS.id.hex()) | HEADER_TEXT, layout=st.none() | LAYOUTS,
       ttl=st.none() | HEADER_TEXT | st.sampled_from(["1e400", "nan", "-0", "1" + "0" * 400, "60"]),
       body=st.binary(max_size=64), token=TOKENS)
def test_single_block_routes_answer_bad_input_with_4xx(daemon, caplog, method, key, ns, layout, ttl, body, token):
    block_route(daemon, caplog, method, key, ns, layout, ttl, body, token)


def frames() -> st.SearchStrategy[bytes]:
    """KVB1 batch bodies: well-formed frames with fuzzed fields, then cut or extended at random."""
    meta = st.one_of(st.just(b""), JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=40),
                     DEEP.map(str.encode), st.builds(lambda layout, ttl: json.dumps(
                         {"layout": layout, "ttl_s": ttl}).encode(), LAYOUT_VALUES | JSON, SCALARS))

    def frame(key, ns, m, plen, payload):
        return (bytes([len(key) % 256]) + key + ns + len(m).to_bytes(4, "little") + m
                + plen.to_bytes(8, "little") + payload)
    one = st.builds(frame, st.sampled_from(KEYS) | st.binary(max_size=70), st.just(NS.id) | st.binary(min_size=16,
                    max_size=16), meta, st.integers(0, 80) | st.integers(0, 2 ** 64 - 1), st.binary(max_size=80))
    return st.builds(lambda count, fs, cut, tail: (wire.stream_header(count) + b"".join(fs))[:cut] + tail,
                     st.integers(0, 2 ** 32 - 1) | st.integers(0, 4), st.lists(one, max_size=3),
                     st.integers(0, 10 ** 6), st.binary(max_size=16))


def batch_put(daemon, caplog, body: bytes, token, native: bool) -> None:
    caplog.clear()
    status, reply = daemon.call("POST", "/v1/blocks/batch_put", body, headers_for(token), chunked=not native)
    check(daemon, caplog, status, reply, ("batch_put", "native" if native else "aiohttp", body[:120]))


@fuzz(FAST * 2)
@given(body=frames(), token=st.sampled_from([ALICE, ALICE, None, "x" * 32]), native=st.booleans())
def test_batch_put_answers_bad_frames_with_4xx_on_both_paths(daemon, caplog, body, token, native):
    batch_put(daemon, caplog, body, token, native)


OTHER_ROUTES = [("GET", "/healthz"), ("GET", "/v1/stats"), ("GET", "/metrics"), ("GET", "/v1/shm"),
                ("HEAD", "/healthz"), ("HEAD", "/v1/stats"), ("HEAD", "/metrics"), ("HEAD", "/v1/shm"),
                ("POST", "/v1/nonexistent"), ("DELETE", "/v1/blocks/00"), ("GET", "/v1/lookup")]


def other_route(daemon, caplog, method, path, query, body, token) -> None:
    caplog.clear()
    status, reply = daemon.call(method, path + query, body or None, headers_for(token))
    assert not 300 <= status < 400, (method, path, status)
    check(daemon, caplog, status, reply, (method, path, query, body[:80]), json_reply=method != "HEAD")


@fuzz()
@given(route=st.sampled_from(OTHER_ROUTES), query=st.just("") | st.text(max_size=30).map(
    lambda q: "?" + urllib.parse.quote(q, safe="=&")), body=st.binary(max_size=100), token=TOKENS)
def test_other_routes_answer_bad_input_with_4xx(daemon, caplog, route, query, body, token):
    other_route(daemon, caplog, *route, query, body, token)


def raw_request(daemon, caplog, head: bytes) -> None:
    """A request head of fuzzed bytes: the daemon answers it (never 5xx) before the client's
    timeout. A head that promises a body is followed by the end of the client's side instead
    (the daemon may then close without a word: asyncio closes a half-closed connection)."""
    caplog.clear()
    promises_body = re.search(rb"(?i)content-length|transfer-encoding|expect", head) is not None
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=20) as sock:
        sock.sendall(head)
        if promises_body:
            sock.shutdown(socket.SHUT_WR)
        reply = b""
        while b"\r\n" not in reply and (chunk := sock.recv(1 << 16)):
            reply += chunk
    first = reply.split(b"\r\n", 1)[0]
    assert not re.match(rb"HTTP/1.. 5", first), (head[:200], reply[:300])
    if not promises_body:
        assert re.match(rb"HTTP/1.. [1-4]", first), (head[:200], reply[:300])
    check(daemon, caplog, 200, b"", ("raw", head[:200]))


HEAD_LINES = st.one_of(
    st.tuples(st.sampled_from([b"Content-Length", b"Transfer-Encoding", b"Authorization", b"Connection", b"Expect",
                               b"Host", b"X-KVCache-Namespace", b"Content-Type"]),
              st.binary(max_size=30) | st.sampled_from([b"9" * 5000, b"-1", b"0x10", b"chunked", b"close",
                                                        b"100-continue", b"Bearer " + ALICE.encode(), b" 5 "]))
    .map(lambda kv: kv[0] + b": " + kv[1]),
    st.binary(max_size=40))


@fuzz(FAST * 2)
@given(method=st.sampled_from([b"GET", b"POST", b"PUT", b"HEAD", b"\x16\x03", b"G\x00T"]) | st.binary(max_size=8),
       path=st.sampled_from([b"/v1/blocks/batch_put", b"/healthz", b"/v1/exists", b"/" + b"a" * 9000])
       | st.binary(max_size=30),
       version=st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 x", b""]),
       lines=st.lists(HEAD_LINES, max_size=5))
def test_fuzzed_request_heads_are_answered_or_closed_never_a_5xx(daemon, caplog, method, path, version, lines):
    raw_request(daemon, caplog, b"\r\n".join([method + b" " + path + b" " + version, *lines]) + b"\r\n\r\n")


def test_the_fuzzed_routes_are_every_route(daemon):
    fuzzed = {(m, p) for m, p in OTHER_ROUTES} | {("POST", p) for p in JSON_ROUTES} \
        | {(m, "/v1/blocks/{key}") for m in ("GET", "HEAD", "PUT")} | {("POST", "/v1/blocks/batch_put")}
    routes = {(r.method, r.resource.canonical) for r in daemon.app.router.routes()}
    assert routes <= fuzzed, sorted(routes - fuzzed)


def test_the_daemon_still_serves_after_the_fuzzing(daemon):
    still_serves(daemon)


@pytest.mark.slow
@fuzz(400)
@given(data=st.data())
def test_every_route_at_length(daemon, caplog, data):
    kind = data.draw(st.sampled_from(["json", "block", "frames", "other"]))
    if kind == "json":
        json_route(daemon, caplog, data.draw(st.sampled_from(JSON_ROUTES)), data.draw(BODIES), data.draw(TOKENS),
                   data.draw(st.booleans()))
    elif kind == "block":
        block_route(daemon, caplog, data.draw(st.sampled_from(["GET", "HEAD", "PUT"])), data.draw(PATH_KEYS),
                    data.draw(st.none() | st.just(NS.id.hex()) | HEADER_TEXT), data.draw(st.none() | LAYOUTS),
                    data.draw(st.none() | HEADER_TEXT), data.draw(st.binary(max_size=64)), data.draw(TOKENS))
    elif kind == "frames":
        batch_put(daemon, caplog, data.draw(frames()), data.draw(st.sampled_from([ALICE, None])),
                  data.draw(st.booleans()))
    else:
        other_route(daemon, caplog, *data.draw(st.sampled_from(OTHER_ROUTES)), "", data.draw(st.binary(max_size=50)),
                    data.draw(TOKENS))
    if data.draw(st.integers(0, 19)) == 0:
        still_serves(daemon)
