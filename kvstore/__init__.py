"""Content addressing, the block format, the index and the store facade.

Dependencies stay at the leaves: the store core imports only the stdlib, lmdb,
xxhash, zstandard and numpy. It never imports torch; aiohttp only in the daemon client
(client.py) and pyarrow only in the event log (event_log.py), both leaves.
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
