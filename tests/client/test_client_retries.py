"""The clients' retries (client/async_client.py's contract) against a tiny flaky daemon: idempotent
calls are retried with the same request, delete never is, and a daemon that stays down is a
DaemonError naming the attempts."""

import pytest
from aiohttp import web

from kvcache.client.async_client import DaemonError
from kvcache.client.sync_client import KVClient
from kvcache.kvstore import Tier, wire
from kvcache.kvstore.types import PutItem
from tests.client.test_client import ServerThread
from tests.conftest import NS


class Flaky:
    """A tiny daemon: the first `fail` GETs answer 503; delete always answers 503."""

    def __init__(self, fail: int):
        self.fail, self.gets, self.deletes = fail, 0, 0
        app = web.Application(client_max_size=16 << 20)
        app.router.add_get("/v1/blocks/{key}", self.get)
        app.router.add_post("/v1/delete", self.delete)
        app.router.add_post("/v1/blocks/batch_put", self.batch_put)
        app.router.add_post("/v1/blocks/batch_get", self.batch_get)
        self.bodies, self.batch_gets = [], 0
        self.srv = ServerThread(app)

    async def get(self, request):
        self.gets += 1
        if self.gets <= self.fail:
            return web.json_response({"error": "store_unavailable", "message": "busy"}, status=503)
        return web.Response(body=b"hello")

    async def delete(self, request):
        self.deletes += 1
        return web.json_response({"error": "store_unavailable", "message": "busy"}, status=503)


    async def batch_put(self, request):
        self.bodies.append(await request.read())
        if len(self.bodies) == 1:
            return web.json_response({"error": "store_unavailable", "message": "busy"}, status=503)
        return web.json_response({"stored": 2, "already_present": 0, "durable": True})

    async def batch_get(self, request):
        """Answers the first request with a stream cut in the middle of a frame."""
        self.batch_gets += 1
        keys = [bytes.fromhex(k) for k in (await request.json())["keys"]]
        frames = b"".join(b"".join(wire.encode_get_frame(k, k * 4, Tier.NVME)) for k in keys)
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(wire.stream_header(len(keys)) + (frames[:-5] if self.batch_gets == 1 else frames))
        if self.batch_gets == 1:
            request.transport.close()
            return resp
        await resp.write_eof()
        return resp


@pytest.fixture
def flaky():
    f = Flaky(fail=2)
    yield f
    f.srv.close()


def test_idempotent_get_is_retried(flaky):
    with KVClient(flaky.srv.url, "t", retries=3, backoff_s=0.01) as c:
        assert c.get(b"k" * 16) == b"hello"
    assert flaky.gets == 3


def test_retries_give_up_with_the_daemon_error(flaky):
    with KVClient(flaky.srv.url, "t", retries=1, backoff_s=0.01) as c:
        with pytest.raises(DaemonError) as e:
            c.get(b"k" * 16)
    assert e.value.status == 503 and e.value.code == "store_unavailable" and flaky.gets == 2


def test_put_many_is_retried_with_the_same_body(flaky):
    with KVClient(flaky.srv.url, "t", retries=3, backoff_s=0.01) as c:
        r = c.put_many([PutItem(b"k" * 16, b"x" * 100, NS.id), PutItem(b"j" * 16, b"y" * (1 << 20), NS.id)])
    assert r.stored == 2 and len(flaky.bodies) == 2 and flaky.bodies[0] == flaky.bodies[1]


def test_truncated_batch_get_stream_is_retried(flaky):
    keys = [b"a" * 16, b"b" * 16]
    with KVClient(flaky.srv.url, "t", retries=3, backoff_s=0.01) as c:
        assert c.get_many(keys) == [k * 4 for k in keys]
    assert flaky.batch_gets == 2


def test_delete_is_not_retried(flaky):
    with KVClient(flaky.srv.url, "t", retries=3, backoff_s=0.01) as c:
        with pytest.raises(DaemonError):
            c.delete([b"k" * 16])
    assert flaky.deletes == 1


def test_unreachable_daemon(tmp_path):
    srv = ServerThread(web.Application())
    url = srv.url
    srv.close()   # nothing listens there any more
    with KVClient(url, "t", retries=2, backoff_s=0.01, connect_timeout_s=2) as c:
        with pytest.raises(DaemonError, match="3 attempt"):
            c.lookup([b"k" * 16])
    with pytest.raises(DaemonError, match="closed"):
        c.get(b"k" * 16)
