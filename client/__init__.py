"""Clients of the `kvcache serve` daemon, and the opener that picks a store from a string.

    async_client.py   AsyncKVClient: the asyncio client (aiohttp), with the daemon's error table
    async_wire.py     its side of the HTTP bodies: KVB1 uploads, batch_get frames, error answers
    sync_client.py    KVClient: the blocking client (bulk paths in the calling thread)
    common.py         what both share: errors mapped from the daemon's answers, put batches
    blocking_http.py  blocking HTTP/1.1 for the bulk calls (sendmsg of frame pieces)
    shm_client.py     same-host reads through the daemon's shared-memory arena
    shm_channel.py    the shared-memory control socket, asyncio and blocking ends
    open_store.py     open_store(spec): a BlockStore for a directory, a KVClient for a URL

Importing this package, a client or open_store loads neither LMDB nor the tiers nor BlockStore:
open_store imports the store core only when the spec names a directory (tests/client/test_imports.py).
Both clients keep kvstore/protocol.py's contract (Store, AsyncStore). The wire formats the
clients speak stay in the store package (kvstore/wire.py, kvstore/shm_wire.py,
kvstore/shm_directory.py), because the daemon and the store core read and write them too.
"""
