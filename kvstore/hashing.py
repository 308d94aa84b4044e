"""THE block-hash function. Nothing else in the project computes block keys.

    namespace root = H("kvcache.namespace" | scheme | algo | model fp | kv layout | block size | salt)

    tokens:  [ t0 ............ t255 | t256 .......... t511 | t512 ... (partial: not hashed)
    keys:      k0 = H(root | k-1.. )  k1 = H(k0 | tokens | extra)
               ^ parent = root        ^ parent = k0

    key_i = H( parent_i | u32 n_tokens | tokens_i as little-endian int32 | framed extra keys )

Every field is length-framed, so no two different inputs share a byte string. The hash is
seeded by nothing but its inputs: never Python's salted `hash()`, never a random seed, so
every process, rank and restart computes the same keys (the silent 0 % hit rate that
LMCache and vLLM users hit). xxh3-128 is the default; sha256 is for deployments that do not
trust their tenants (a crafted collision could otherwise poison another tenant's prefix).

A request's cache salt (one per tenant, or per sharing group of tenants) starts its chain at a
salted root instead (`salted_root`): requests with different salts share no block key, so none
finds (or times) another's prefix, in the engine's pool or in the store; the salt "" is the
namespace root itself, so unsalted keys stay as they were.

The keys of exact mode's tail snapshots are derived here too (`snapshot_key`, `end_snapshot_key`):
blake2b over a tag, the block key and, for an end snapshot, its tokens packed as little-endian int64.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import xxhash

from kvcache.kvstore.types import utf8_len

SCHEME_VERSION = 1
_U32 = struct.Struct("<I")
ExtraKey = bytes | str | int


class HashAlgo(str, enum.Enum):
    XXH3_128 = "xxh3-128"
    SHA256 = "sha256"

    @property
    def digest_size(self) -> int:
        return 16 if self is HashAlgo.XXH3_128 else 32

    def new(self):
        return xxhash.xxh3_128() if self is HashAlgo.XXH3_128 else hashlib.sha256()


def _frame(h, part: bytes) -> None:
    h.update(_U32.pack(len(part)))
    h.update(part)


def _extra_bytes(extra: Iterable[ExtraKey]) -> bytes:
    """Canonical bytes of extra keys (LoRA ids, image hashes...): type-tagged and framed."""
    out = bytearray()
    for item in extra:
        if isinstance(item, bool) or item is None:
            raise TypeError(f"extra keys must be bytes, str or int, got {item!r}")
        if isinstance(item, bytes):
            tag, body = b"b", item
        elif isinstance(item, str):
            tag, body = b"s", item.encode()
        elif isinstance(item, int):
            tag, body = b"i", item.to_bytes(16, "little", signed=True)
        else:
            raise TypeError(f"extra keys must be bytes, str or int, got {type(item).__name__}")
        out += tag + _U32.pack(len(body)) + body
    return bytes(out)


MAX_BLOCK_SIZE = 0xFFFFFFFF


@dataclass(frozen=True)
class Namespace:
    """Everything a block key depends on besides the tokens.

    `name` is a human label for configs and reports (retention overrides are keyed by it);
    it is not hashed, so the name plays no part in block keys. Registering a namespace again
    under another name renames it (with no name, it keeps the one it has).

    `owner` is the tenant that registered it through the daemon ("" for a store used directly
    or a daemon without tokens). It is not part of the root either (block keys stay the
    client's), but it is part of the id, so each tenant's namespaces live apart:

        client id = root[:16]                      what the client computes and sends
        id        = tenant_namespace_id(owner, client id)   what blocks and the index carry
    """

    model_fingerprint: str
    kv_layout: str
    block_size: int
    tenant_salt: str = ""
    algo: HashAlgo = HashAlgo.XXH3_128
    scheme_version: int = SCHEME_VERSION
    name: str = ""
    owner: str = ""

    def __post_init__(self) -> None:
        for field in ("model_fingerprint", "kv_layout", "tenant_salt", "name", "owner"):
            value = getattr(self, field)       # persisted and used as dict keys: never a list
            if utf8_len(value) < 0:
                raise ValueError(f"namespace {field} must be a UTF-8 string, got {value!r}"[:200])
        if not self.model_fingerprint or not self.kv_layout:
            raise ValueError("a namespace needs a model_fingerprint and a kv_layout")
        if type(self.block_size) is not int or not 0 < self.block_size <= MAX_BLOCK_SIZE:   # hashed as a u32
            raise ValueError(f"block_size must be an int in 1..{MAX_BLOCK_SIZE}, got {self.block_size!r}"[:200])
        object.__setattr__(self, "algo", HashAlgo(self.algo))
        if self.scheme_version != SCHEME_VERSION:
            raise ValueError(f"hash scheme {self.scheme_version} unsupported; this build speaks {SCHEME_VERSION}")

    @functools.cached_property
    def root(self) -> bytes:
        """Computed once per namespace object (frozen, so it cannot change); it sits on every put."""
        h = self.algo.new()
        for part in (b"kvcache.namespace", _U32.pack(self.scheme_version), self.algo.value.encode(),
                     self.model_fingerprint.encode(), self.kv_layout.encode(),
                     _U32.pack(self.block_size), self.tenant_salt.encode()):
            _frame(h, part)
        return h.digest()

    @functools.cached_property
    def client_id(self) -> bytes:
        """The id a client computes from the fields it hashes: the owner plays no part."""
        return self.root[:16]

    @functools.cached_property
    def id(self) -> bytes:
        """16-byte namespace id stored in every block header and index entry."""
        return tenant_namespace_id(self.owner, self.client_id)

    def to_dict(self) -> dict:
        d = {"model_fingerprint": self.model_fingerprint, "kv_layout": self.kv_layout,
             "block_size": self.block_size, "tenant_salt": self.tenant_salt,
             "algo": self.algo.value, "scheme_version": self.scheme_version, "name": self.name}
        if self.owner:    # left out when "": an index without tenants stays readable by older builds
            d["owner"] = self.owner
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Namespace":
        """From to_dict's fields; others (a newer build's, a typo) are a ValueError that names them."""
        if not isinstance(d, dict):
            raise ValueError(f"a namespace is a JSON object, got {type(d).__name__}")
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown namespace fields {sorted(unknown)} (known: {sorted(cls.__dataclass_fields__)}); "
                             "written by a newer kvcache?")
        missing = [f for f in ("model_fingerprint", "kv_layout", "block_size") if f not in d]
        if missing:
            raise ValueError(f"a namespace needs {missing}")
        return cls(**d)


def _as_tokens(tokens) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 0x7FFFFFFF):
        raise ValueError("token ids must lie in [0, 2**31 - 1]")
    return np.ascontiguousarray(arr, dtype="<i4")    # a strided view would have no .data to hash


def hash_block(ns: Namespace, parent: bytes | None, tokens, extra: Sequence[ExtraKey] = ()) -> bytes:
    """Key of one full block whose predecessor has key `parent` (None: first block)."""
    arr = _as_tokens(tokens)
    if arr.size != ns.block_size:
        raise ValueError(f"a block holds exactly {ns.block_size} tokens, got {arr.size}")
    return _chain(ns.algo, ns.root if parent is None else parent, arr, _extra_bytes(extra))


def _chain(algo: HashAlgo, parent: bytes, row: np.ndarray, extra: bytes) -> bytes:
    h = algo.new()
    h.update(parent)
    h.update(_U32.pack(row.size))
    h.update(row.data)
    _frame(h, extra)
    return h.digest()


def hash_blocks(ns: Namespace, tokens, extra_keys=None, parent: bytes | None = None) -> list[bytes]:
    """Keys of every full block of `tokens` (the partial tail is not hashed).

    `extra_keys` is None, one sequence applied to every block, or a list with one sequence
    per full block. The token array is converted once; each block then costs one hash call
    over a view of it (a 128k-token prompt in 256-token blocks: ~500 calls, well under 1 ms
    of hashing at memory bandwidth).
    """
    arr = _as_tokens(tokens)
    n = arr.size // ns.block_size
    rows = arr[: n * ns.block_size].reshape(n, ns.block_size)
    if extra_keys is None:
        extras = [b""] * n
    elif extra_keys and isinstance(extra_keys[0], (list, tuple)):
        if len(extra_keys) < n:
            raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n} full blocks")
        extras = [_extra_bytes(e) for e in extra_keys[:n]]
    else:
        extras = [_extra_bytes(extra_keys)] * n
    keys: list[bytes] = []
    prev = ns.root if parent is None else parent
    for i in range(n):
        prev = _chain(ns.algo, prev, rows[i], extras[i])
        keys.append(prev)
    return keys


def salted_root(ns: Namespace, salt: str) -> bytes:
    """Where the block-key chain of a request with cache salt `salt` starts (hash_blocks' `parent`
    for its first block): H("kvcache.cache-salt" | namespace root | salt), framed, as long as the
    namespace's keys. The salt "" is no salt: the namespace root, so its keys are today's."""
    if not salt:
        return ns.root
    h = ns.algo.new()
    for part in (b"kvcache.cache-salt", ns.root, salt.encode()):
        _frame(h, part)
    return h.digest()


def engine_key(ns: Namespace, key: bytes, part: str = "") -> bytes:
    """A block key another engine computed itself (SGLang's chained SHA-256 page hashes), placed in
    namespace `ns`: H("kvcache.engine-key" | root | key | part), framed, as long as the root. `part`
    names one of several payloads under the same engine key (SGLang's pools: "kv", "mamba", ...);
    "" is the first. The engine's chain already covers the tokens and their order; the root adds
    what it does not (model, layout, dtype, rank, tenant salt)."""
    h = ns.algo.new()
    for p in (b"kvcache.engine-key", ns.root, key, part.encode()):
        _frame(h, p)
    return h.digest()


def snapshot_key(block_key: bytes) -> bytes:
    """Where the tail snapshot taken right after block `block_key` lives (as long as the key)."""
    return hashlib.blake2b(b"kvcache-tail-snapshot-v1" + block_key, digest_size=len(block_key)).digest()


def end_snapshot_key(prev: bytes, tail: Sequence[int], size: int) -> bytes:
    """Where the snapshot of a request that ended `len(tail)` tokens into a block lives: `prev` is
    the key of the last full block before it (or the namespace id when there is none); `size`
    bytes, as long as the namespace's block keys (16, or 32 with sha256).

    The tokens are packed as explicit little-endian int64. Keys stored before this packing was
    explicit used the host's int64 order (array("q")): on little-endian hosts, the only ones
    supported, those are the same bytes, so they stay readable (the golden vectors in
    tests/kvstore/test_hashing.py were computed with that code)."""
    packed = struct.pack(f"<{len(tail)}q", *tail)
    return hashlib.blake2b(b"kvcache-end-snapshot-v1" + prev + packed, digest_size=size).digest()


def tenant_key(tenant: str, key: bytes) -> bytes:
    """The key a tenant's block is stored under: the tenant's own key space.

    Two tenants sending the same block key get different stored keys, so neither can read,
    pin, delete or detect the other's blocks. The anonymous tenant "" keeps keys as they are.
    The stored key has the length of the sent one (xxh3-128 for 16 bytes, sha256 for 32).
    Only the daemon without tokens (one trust domain) and a store used directly have tenant "":
    every token names a tenant (server/config.py), so no token reaches the raw key space.
    """
    if not tenant:
        return key
    if len(key) < 16:    # the stored key is as long as the sent one: 1-8 bytes would collide across tenants
        raise ValueError(f"a tenant's block keys are at least 16 bytes (block hashes), got {len(key)}")
    h = xxhash.xxh3_128() if len(key) <= 16 else hashlib.sha256()
    for part in (b"kvcache.tenant", tenant.encode(), key):
        _frame(h, part)
    return h.digest()[: len(key)]


@functools.lru_cache(maxsize=4096)     # on every put; a daemon sees few (tenant, namespace) pairs
def tenant_namespace_id(tenant: str, client_id: bytes) -> bytes:
    """The id a tenant's namespace is stored under; the tenant "" keeps the client's id.

    sha256, not xxh3: a tenant chooses the fields it registers, and a crafted collision with
    another tenant's id would reach that tenant's namespace name (and so its retention).
    """
    if not tenant:
        return client_id
    h = hashlib.sha256()
    for part in (b"kvcache.tenant-namespace", tenant.encode(), client_id):
        _frame(h, part)
    return h.digest()[:16]
