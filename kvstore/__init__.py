"""Content addressing, the block format, the index and the store facade.

Dependencies stay at the leaves: the store core imports only the stdlib, lmdb,
xxhash, zstandard and numpy. It never imports torch nor aiohttp (the daemon's clients are
kvcache.client), and pyarrow only in the event log (event_log.py), a leaf.

The seam: `types.py` (PutItem, LookupResult, PutResult, StoreStats, ...) and `protocol.py` (Store,
AsyncStore: the methods BlockStore and both clients share, each with its contract) import nothing
heavy, so code written against them loads neither LMDB nor the tiers.

The wire formats stay here, not beside the clients: `wire.py` (batch framing), `shm_wire.py`
(the shared-memory control socket) and `shm_directory.py` (the read directory's layout) are
spoken by the store core (the DRAM tier writes the directory, leases.py reads its horizon), the
daemon (server/) and the clients alike. Here, the bottom of the dependency order, each of them
imports them without an import cycle; they import only types.py and errors.py.
"""

from kvcache.kvstore.errors import (
    BlockFormatError,
    CorruptBlockError,
    NamespaceLimitError,
    StoreError,
    StoreLockedError,
    TierFullError,
    UnknownNamespaceError,
)
from kvcache.kvstore.hashing import HashAlgo, Namespace, hash_block, hash_blocks
from kvcache.kvstore.types import BlockMeta, LookupResult, PutResult, Tier, TensorSpec

__all__ = [
    "BlockFormatError",
    "BlockMeta",
    "CorruptBlockError",
    "HashAlgo",
    "LookupResult",
    "Namespace",
    "NamespaceLimitError",
    "PutResult",
    "StoreError",
    "StoreLockedError",
    "TensorSpec",
    "Tier",
    "TierFullError",
    "UnknownNamespaceError",
    "hash_block",
    "hash_blocks",
]
