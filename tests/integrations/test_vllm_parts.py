"""The vLLM connector's parts that need no vLLM: settings, block naming and keys, whole-block copies."""

from __future__ import annotations

import pytest
import torch

from kvcache.kvstore.types import copy_pieces
from kvcache.integrations.vllm.kv_blocks import KVBlocks
from kvcache.integrations.vllm.naming import BlockNaming, KeyChain, ParallelLayout, request_salt
from kvcache.integrations.settings import ConnectorSettings
from kvcache.kvstore.hashing import hash_blocks, salted_root

NAMING = BlockNaming(model="vllm:/m@main", dtype="float32", kv_heads=2, head_size=64, block_size=4,
                     backend="auto", device="cpu-avx2", parallel=ParallelLayout(tp_size=2))


def test_settings_refuse_unknown_and_mistyped_keys():
    assert ConnectorSettings.from_extra_config({"store": "http://h:1", "save": False}).save is False
    with pytest.raises(ValueError, match="unknown setting"):
        ConnectorSettings.from_extra_config({"stor": "http://h:1"})
    with pytest.raises(ValueError, match="load_timeout_s"):
        ConnectorSettings.from_extra_config({"load_timeout_s": "5"})
    with pytest.raises(ValueError, match="save"):
        ConnectorSettings.from_extra_config({"save": 1})
    with pytest.raises(ValueError, match="positive"):
        ConnectorSettings.from_extra_config({"timeout_s": 0})
    assert ConnectorSettings.from_extra_config({"load_timeout_s": 5}).load_timeout_s == 5


def test_store_spec_and_token_fall_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("KVCACHE_STORE", "http://10.0.0.1:8790")
    monkeypatch.setenv("KVCACHE_TOKEN", "t" * 20)
    s = ConnectorSettings.from_extra_config({})
    assert s.store_spec == "http://10.0.0.1:8790" and s.bearer == "t" * 20
    monkeypatch.delenv("KVCACHE_STORE")
    assert ConnectorSettings.from_extra_config({}).store_spec == "http://127.0.0.1:8790"


def test_every_rank_and_layout_has_its_own_namespace():
    roots = {ns.root for ns in NAMING.namespaces()}
    assert len(roots) == 2
    other_isa = BlockNaming(**{**NAMING.__dict__, "device": "cpu-avx512"})
    assert not roots & {ns.root for ns in other_isa.namespaces()}
    assert "tp1/2" in NAMING.layout(1, 0) and "cpu-avx2" in NAMING.layout(0, 0)


def test_key_chain_extends_incrementally_to_the_one_shot_hash():
    tokens = list(range(50))
    chain = KeyChain(NAMING.namespaces(), request_salt("s1", None))
    chain.extend(tokens, 3)
    chain.extend(tokens, 3)
    chain.extend(tokens, 12)
    for r, ns in enumerate(NAMING.namespaces()):
        assert chain.keys[r] == hash_blocks(ns, tokens[:48], parent=salted_root(ns, "s1"))
    assert chain.keys[0] != chain.keys[1]
    other = KeyChain(NAMING.namespaces(), request_salt("s1", "adapter"))
    other.extend(tokens, 2)
    assert other.keys[0][0] != chain.keys[0][0]       # another LoRA adapter, other keys
    assert chain.slice(1, 3) == [k[1:3] for k in chain.keys]


@pytest.mark.parametrize("block_dim", [0, 1])
def test_whole_blocks_gather_and_scatter_across_layers(block_dim):
    num_blocks = 6
    shape = [num_blocks, 2, 4, 8] if block_dim == 0 else [2, num_blocks, 4, 2, 8]
    layers = {f"layer{i}": torch.randn(*shape) for i in range(3)}
    kv = KVBlocks(layers, num_blocks)
    assert kv.payload_bytes == 3 * layers["layer0"].numel() // num_blocks * 4 and len(kv.layout) == 3
    staging = kv.gather([4, 1])
    assert staging.shape == (2, kv.payload_bytes)
    target = {k: torch.zeros_like(v) for k, v in layers.items()}
    into = KVBlocks(target, num_blocks)
    into.scatter(staging, [1], [0])                    # only the rows that loaded are copied
    for name, t in target.items():
        src, dst = layers[name].movedim(block_dim, 0), t.movedim(block_dim, 0)
        assert torch.equal(dst[0], src[1])
        assert not dst[1:].any()


@pytest.mark.parametrize("block_dim,dtype", [(0, torch.float32), (1, torch.float32), (0, torch.bfloat16)])
def test_direct_destinations_are_where_gather_takes_each_block_from(block_dim, dtype):
    """A payload read into destinations(ids) lands exactly where gather reads it back from:
    one byte run per layer, or one per K/V half where the block dimension is not first."""
    num_blocks = 5
    shape = [num_blocks, 2, 4, 8] if block_dim == 0 else [2, num_blocks, 4, 2, 8]
    per = torch.Size(shape).numel()
    buf = torch.zeros(3 * per, dtype=dtype)            # layers as views into one buffer, as vLLM's are
    layers = {f"layer{i}": buf[i * per:(i + 1) * per].view(*shape) for i in range(3)}
    kv = KVBlocks(layers, num_blocks)
    assert kv.direct
    dests = kv.destinations([3, 0])
    assert [d.nbytes for d in dests] == [kv.payload_bytes] * 2
    assert len(dests[0].parts) == (3 if block_dim == 0 else 6)
    payloads = [torch.randint(0, 255, (kv.payload_bytes,), dtype=torch.uint8) for _ in dests]
    for d, p in zip(dests, payloads):
        copy_pieces(d.pieces(kv.payload_bytes), memoryview(p.numpy()))
    back = kv.gather([3, 0])
    assert torch.equal(back[0], payloads[0]) and torch.equal(back[1], payloads[1])
    assert not torch.stack([v[1] for v in kv.views]).any()          # other blocks untouched


def test_no_direct_destinations_for_blocks_that_are_not_byte_runs():
    t = torch.zeros(4, 6, 3).transpose(1, 2)         # a block is [3, 6] with strides (1, 3): no runs
    assert not KVBlocks({"l": t}, 4).direct
    heads_first = {f"l{i}": torch.zeros(2, 8, 3, 4).movedim(0, 1) for i in range(300)}   # 2 runs a layer
    assert not KVBlocks(heads_first, 8).direct      # 600 runs: more than a Scatter takes
    kv = KVBlocks({"l": torch.zeros(4, 2, 8)}, 4)
    with pytest.raises(ValueError, match="outside"):
        kv.destinations([4])
    with pytest.raises(ValueError, match="outside"):
        kv.destinations([-1])


def test_a_tensor_without_the_block_count_is_refused():
    with pytest.raises(ValueError, match="no dimension"):
        KVBlocks({"l": torch.zeros(3, 4)}, 7)
