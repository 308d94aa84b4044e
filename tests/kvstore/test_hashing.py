"""Block keys: golden vectors (frozen: changing them breaks every stored cache), the
documented byte layout, determinism across processes, and input validation."""

import dataclasses
import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvcache.kvstore import HashAlgo, Namespace, hash_block, hash_blocks
from kvcache.kvstore.hashing import end_snapshot_key, engine_key, salted_root, snapshot_key

NS = Namespace("deepseek-v4.1-flash@flash-1017", "v41-csa2-rows/bf16/v1", 256)
NS_SHA = Namespace("deepseek-v4.1-flash@flash-1017", "v41-csa2-rows/bf16/v1", 256,
                   algo=HashAlgo.SHA256, tenant_salt="acme")

GOLDEN_ROOT = "75c02cf0fa2bbadabf1ff4bbfcb479ce"
GOLDEN_KEYS = ["b03b304d7630543d8d98692090628c6e", "6e90c3d660d11d8bb700929bf3004248",
               "bf716f8c0bd86e61e52a180e1eb363ef", "efee77ca8f56a109b59e2034d05c1fbd"]
GOLDEN_SHA_ROOT = "d8b12c84377e5fa9ac020c2317b747a7d717ee7d2da451244b9cf446b7e1b6fd"
GOLDEN_SHA_KEYS = ["803aa4139930909a6e706999f78d9b12d4acc901cf21305b04e45a3e65b8a807",
                   "59837619d0672d5afb956fb8558a16d8ae00569476061f38ebb45e971e23eef9"]
GOLDEN_EXTRA_KEYS = ["3d200886cbb068ec5098f39ff9167081", "130faaa73c15a8fcf3208e3a41e08cc0"]


def test_golden_xxh3():
    assert NS.root.hex() == GOLDEN_ROOT
    assert [k.hex() for k in hash_blocks(NS, np.arange(1024) % 1000)] == GOLDEN_KEYS


def test_golden_sha256_with_salt():
    assert NS_SHA.root.hex() == GOLDEN_SHA_ROOT
    assert [k.hex() for k in hash_blocks(NS_SHA, np.arange(512))] == GOLDEN_SHA_KEYS


def test_golden_extra_keys():
    keys = hash_blocks(NS, np.arange(512), extra_keys=("lora:a", 7, b"\x01"))
    assert [k.hex() for k in keys] == GOLDEN_EXTRA_KEYS


# tail snapshot keys (exact mode), computed with the code that wrote them before their packing
# was explicit (array("q"), the host's order): stored snapshots must keep these keys
K16, K32 = bytes(range(16)), bytes(range(32))
GOLDEN_SNAPSHOT = {16: "257d060dc7cb87cd252d76de99151161",
                   32: "4ad51ee049b107c4b0769599f3ef5b68a98df7a0f91cbb406d62676751cf3a74"}
GOLDEN_END_SNAPSHOT = [
    (K16, [3, 4, 5, 70000], 16, "b62c668b4b4e4f87c4754389ffd2ae3a"),
    (K32, [0, 1, 2**40], 32, "8671087ae8d73ec3c2f918e7727a0084f762e978004c22c764c389c85b9debbd"),
    (K16, [], 16, "cbb1332ba49a03cdefb67c88e8c15d46"),
]


def test_golden_snapshot_keys():
    assert snapshot_key(K16).hex() == GOLDEN_SNAPSHOT[16]
    assert snapshot_key(K32).hex() == GOLDEN_SNAPSHOT[32]
    for prev, tail, size, want in GOLDEN_END_SNAPSHOT:
        assert end_snapshot_key(prev, tail, size).hex() == want


def test_end_snapshot_key_packs_tokens_little_endian():
    tail = [1, 300, 2**33]
    want = hashlib.blake2b(b"kvcache-end-snapshot-v1" + K16 + b"".join(t.to_bytes(8, "little") for t in tail),
                           digest_size=16).digest()
    assert end_snapshot_key(K16, tail, 16) == want
    assert end_snapshot_key(K16, np.array(tail), 16) == want      # numpy ids pack the same
    with pytest.raises(struct.error):
        end_snapshot_key(K16, [1.5], 16)


# a request's cache salt: where its chain starts (stored blocks of salted requests keep these keys)
GOLDEN_SALTED_ROOT = {"xxh3-128": "f1b7f8fe871ff3573fe6ab3e593e3906",
                      "sha256": "4057565079abe6fc2f536571fd584680984b96584c497d8da7a85bf320877c69"}


def test_golden_salted_root():
    assert salted_root(NS, "tenant-a").hex() == GOLDEN_SALTED_ROOT["xxh3-128"]
    assert salted_root(NS_SHA, "tenant-a").hex() == GOLDEN_SALTED_ROOT["sha256"]
    by_hand = xxhash.xxh3_128_digest(b"".join(_frame(p) for p in (b"kvcache.cache-salt", NS.root, b"tenant-a")))
    assert salted_root(NS, "tenant-a") == by_hand
    assert len(salted_root(NS_SHA, "tenant-a")) == 32


def test_the_empty_salt_keeps_todays_keys_and_salts_key_apart():
    tokens = np.arange(1024) % 1000
    assert salted_root(NS, "") == NS.root
    assert hash_blocks(NS, tokens, parent=salted_root(NS, "")) == hash_blocks(NS, tokens)
    a, b = (hash_blocks(NS, tokens, parent=salted_root(NS, s)) for s in ("a", "b"))
    assert not set(a) & set(b) and not set(a) & set(GOLDEN_KEYS)
    assert salted_root(NS, "a") != salted_root(dataclasses.replace(NS, block_size=128), "a")


GOLDEN_ENGINE_KEYS = {"xxh3-128": "20781c54f8cd0ce6838a61fe31080cd0",
                      "sha256": "4d4ddf5f9a35d87060f666808c52cf4be0c0ddaa286e7d4a14aa223242a1fd22"}


def test_golden_engine_keys():
    page = bytes.fromhex("ab" * 32)          # an SGLang page hash
    assert engine_key(NS, page).hex() == GOLDEN_ENGINE_KEYS["xxh3-128"]
    assert engine_key(NS_SHA, page, "swa").hex() == GOLDEN_ENGINE_KEYS["sha256"]
    by_hand = xxhash.xxh3_128_digest(b"".join(_frame(p) for p in (b"kvcache.engine-key", NS.root, page, b"")))
    assert engine_key(NS, page) == by_hand
    keys = {engine_key(NS, page), engine_key(NS, page, "swa"), engine_key(dataclasses.replace(NS, kv_layout="x"), page)}
    assert len(keys) == 3                    # a pool, a layout: other keys


def _frame(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def test_matches_documented_layout():
    """Recompute by hand from the layout in kvstore/hashing.py's docstring."""
    root = xxhash.xxh3_128_digest(b"".join(_frame(p) for p in (
        b"kvcache.namespace", struct.pack("<I", 1), b"xxh3-128", NS.model_fingerprint.encode(),
        NS.kv_layout.encode(), struct.pack("<I", 256), b"")))
    assert root == NS.root
    tokens = np.arange(256, dtype="<i4")
    k0 = xxhash.xxh3_128_digest(root + struct.pack("<I", 256) + tokens.tobytes() + _frame(b""))
    assert hash_block(NS, None, tokens) == k0
    sha_root = hashlib.sha256(b"".join(_frame(p) for p in (
        b"kvcache.namespace", struct.pack("<I", 1), b"sha256", NS_SHA.model_fingerprint.encode(),
        NS_SHA.kv_layout.encode(), struct.pack("<I", 256), b"acme"))).digest()
    assert sha_root == NS_SHA.root


def test_chain_and_incremental_agree():
    tokens = np.random.default_rng(0).integers(0, 100_000, 256 * 5 + 17)
    keys = hash_blocks(NS, tokens)
    assert len(keys) == 5  # the partial tail is not hashed
    parent = None
    for i, key in enumerate(keys):
        parent = hash_block(NS, parent, tokens[i * 256:(i + 1) * 256])
        assert parent == key
    # resuming from a parent continues the chain
    assert hash_blocks(NS, tokens[512:], parent=keys[1]) == keys[2:]


def test_every_input_matters():
    tokens = np.arange(512)
    base = hash_blocks(NS, tokens)
    changed = tokens.copy()
    changed[300] += 1
    assert hash_blocks(NS, changed)[0] == base[0] and hash_blocks(NS, changed)[1] != base[1]
    for field, value in (("model_fingerprint", "other"), ("kv_layout", "other"), ("block_size", 128),
                         ("tenant_salt", "t2"), ("algo", HashAlgo.SHA256)):
        kw = {f.name: getattr(NS, f.name) for f in dataclasses.fields(NS)} | {field: value}
        assert hash_blocks(Namespace(**kw), tokens)[0] != base[0], field
    # the label is not part of the address
    assert hash_blocks(dataclasses.replace(NS, name="x"), tokens) == base
    assert hash_blocks(NS, tokens, extra_keys=("lora",)) != base
    # framing: a str and bytes extra key with the same bytes differ
    assert hash_blocks(NS, tokens, extra_keys=("a",)) != hash_blocks(NS, tokens, extra_keys=(b"a",))


def test_same_keys_in_other_processes():
    code = ("import numpy as np; from kvcache.kvstore import Namespace, hash_blocks;"
            "ns = Namespace('deepseek-v4.1-flash@flash-1017', 'v41-csa2-rows/bf16/v1', 256);"
            "print(hash_blocks(ns, np.arange(1024) % 1000)[3].hex())")
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == GOLDEN_KEYS[3]


def test_list_and_array_inputs_agree():
    assert hash_blocks(NS, list(range(512))) == hash_blocks(NS, np.arange(512, dtype=np.int64))


@pytest.mark.parametrize("bad, exc", [
    (np.array([1.5] * 256), TypeError),
    (np.array([-1] * 256), ValueError),
    (np.array([2**31] * 256), ValueError),
    (np.zeros((2, 256), dtype=np.int32), ValueError),
])
def test_rejects_bad_tokens(bad, exc):
    with pytest.raises(exc):
        hash_blocks(NS, bad)


def test_rejects_bad_blocks_and_namespaces():
    with pytest.raises(ValueError, match="exactly 256"):
        hash_block(NS, None, np.arange(10))
    with pytest.raises(ValueError):
        Namespace("", "layout", 16)
    with pytest.raises(ValueError):
        Namespace("m", "layout", 0)
    with pytest.raises(TypeError):
        hash_blocks(NS, np.arange(256), extra_keys=(None,))
    with pytest.raises(ValueError, match="entries"):
        hash_blocks(NS, np.arange(512), extra_keys=[("a",)])


def test_whole_prompt_hashing_handles_128k_tokens():
    keys = hash_blocks(NS, np.arange(128 * 1024) % 129_280)
    assert len(keys) == 512 and len(set(keys)) == 512
