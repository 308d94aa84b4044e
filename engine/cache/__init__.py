"""The engine's prefix cache: pool hits, the block store seam, tail snapshots, block payloads.

    prefix_cache.py   PrefixCache: plans hits (pool first, then the store), applies loads, saves
    connector.py      KVConnector: the one seam to a block store (lookup, fetch, save in threads)
    tail_snapshots.py TailSnapshots: where exact mode resumes a hit; recent snapshots in memory
    snapshot.py       tail snapshots: the per-request state blocks do not hold (exact mode)
    block_payload.py  one pool block <-> one store payload (and the layout id in the namespace)
    weights_id.py     the weights' fingerprint in the cache's namespace
"""
