"""KVConnector.get_now, the plug-ins' read: straight into the caller's buffers, no pin (an index
write in the daemon per read that guards nothing by then), a failed read is all misses."""

from types import SimpleNamespace

from kvcache.engine.cache.connector import KVConnector
from kvcache.engine.config import CacheConfig


class Store:
    def __init__(self, blocks: dict, get_error: Exception | None = None):
        self.blocks, self.get_error, self.pins = blocks, get_error, 0

    def register_namespace(self, ns):
        return ns.id

    def pin(self, keys, ttl_s=None):
        self.pins += 1
        return len(keys)

    def get_many_into(self, keys, outs):
        if self.get_error:
            raise self.get_error
        got = []
        for k, o in zip(keys, outs):
            data = self.blocks.get(k)
            if data is not None:
                memoryview(o)[: len(data)] = data
            got.append(None if data is None else len(data))
        return got


def _conn(store) -> KVConnector:
    return KVConnector(store, SimpleNamespace(id=b"n" * 16), (), CacheConfig())


def test_get_now_reads_into_the_buffers_without_a_pin():
    store = Store({b"a": b"xyz", b"b": b"pq"})
    conn = _conn(store)
    outs = [bytearray(4) for _ in range(3)]
    assert conn.get_now([b"a", b"b", b"c"], outs) == [3, 2, None]
    assert bytes(outs[0][:3]) == b"xyz" and bytes(outs[1][:2]) == b"pq" and store.pins == 0
    assert conn.stats["fetched_blocks"] == 2 and conn.stats["failed_blocks"] == 1
    conn.close()


def test_a_failed_read_is_all_misses():
    conn = _conn(Store({b"a": b"xyz"}, get_error=RuntimeError("connection reset")))
    assert conn.get_now([b"a", b"a"], [bytearray(3), bytearray(3)]) == [None, None]
    assert conn.stats["failed_blocks"] == 2
    conn.close()
