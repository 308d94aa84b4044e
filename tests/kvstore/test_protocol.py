"""BlockStore, KVClient and AsyncKVClient keep the store protocol (kvstore/protocol.py): every
method it names, with its parameters (names, kinds, defaults) in order; an implementation may
add parameters only after them, with defaults. A drifting signature fails here."""

import inspect

import pytest

from kvcache.client.async_client import AsyncKVClient
from kvcache.client.sync_client import KVClient
from kvcache.kvstore.protocol import AsyncStore, Store
from kvcache.kvstore.store import BlockStore


def _methods(proto) -> list[str]:
    skip = {"__init__", "__subclasshook__", "__class_getitem__", "__init_subclass__"}
    return [n for n, v in vars(proto).items()
            if inspect.isfunction(v) and n not in skip and (not n.startswith("_") or n.endswith("__"))]


def _drift(proto, impl) -> list[str]:
    out = []
    for name in _methods(proto):
        want, got = getattr(proto, name), getattr(impl, name, None)
        if got is None:
            out.append(f"{impl.__name__}.{name} is missing")
            continue
        if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(got):
            out.append(f"{impl.__name__}.{name}: async in one and not the other")
        wp = list(inspect.signature(want).parameters.values())
        gp = list(inspect.signature(got).parameters.values())
        for w, g in zip(wp, gp):
            if (w.name, w.kind, w.default) != (g.name, g.kind, g.default):
                out.append(f"{impl.__name__}.{name}: parameter {g} where the protocol has {w}")
        if len(gp) < len(wp):
            out.append(f"{impl.__name__}.{name}: lacks {[str(p) for p in wp[len(gp):]]}")
        out += [f"{impl.__name__}.{name}: extra parameter {p} has no default" for p in gp[len(wp):]
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return out


@pytest.mark.parametrize("proto, impl", [(Store, BlockStore), (Store, KVClient), (AsyncStore, AsyncKVClient)],
                         ids=["BlockStore", "KVClient", "AsyncKVClient"])
def test_signatures_follow_the_protocol(proto, impl):
    assert _methods(proto), "the protocol names no methods"
    assert _drift(proto, impl) == []


def test_the_check_catches_a_drifting_signature():
    class Drifted:
        def lookup(self, keys, namespace_id=None):
            ...
    assert any("lookup" in d for d in _drift(Store, Drifted))


def test_instances_satisfy_the_protocol(make_store):
    s = make_store()
    assert isinstance(s, Store)
    client = AsyncKVClient("http://127.0.0.1:1")     # nothing connects until a call
    assert isinstance(client, AsyncStore)
    sync = KVClient("http://127.0.0.1:1")
    try:
        assert isinstance(sync, Store)
    finally:
        sync.close()
