"""The SGLang HiCache backend against a real `kvcache serve` process, through a fake host pool that
has the documented page interface (get_data_page, get_dummy_flat_data_page, set_from_flat_data_page,
page_size, dtype, layout). Where SGLang itself is importable (it needs triton: not in CI), the
backend is also loaded through SGLang's own dynamic-backend factory."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import pytest
import torch

from kvcache.integrations.sglang import KVCacheStorage
from tests.daemon_proc import DaemonProcess, free_port

PAGE = 4
TOKEN_A, TOKEN_B = "acme-" + "a" * 24, "globex-" + "b" * 24


class FakeHostPool:
    """A layer-first MHA host pool: kv_buffer [2, layers, tokens, heads, head_dim]."""

    layout = "layer_first"

    def __init__(self, pages: int = 8, layers: int = 2, heads: int = 2, dim: int = 8, dtype=torch.bfloat16):
        self.page_size, self.dtype, self.device = PAGE, dtype, torch.device("cpu")
        self.shape = (2, layers, PAGE, heads, dim)
        self.kv_buffer = torch.zeros(2, layers, pages * PAGE, heads, dim, dtype=dtype)

    def get_data_page(self, index, flat=True):
        page = self.kv_buffer[:, :, index:index + PAGE]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index, data_page):
        self.kv_buffer[:, :, index:index + PAGE] = data_page.reshape(self.shape)


@dataclass
class Config:
    """HiCacheStorageConfig's fields the backend reads."""
    extra_config: dict
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    model_name: str = "tiny/model"
    is_storage_writer: bool = True


@dataclass
class Transfer:
    name: str
    keys: list
    host_indices: torch.Tensor | None = None
    hit_policy: str = "all_pages"
    group_pages: int = 0
    extra: dict = field(default_factory=dict)


def page_keys(n: int, seed: str = "") -> list[str]:
    """SGLang's form: chained SHA-256 hex digests."""
    keys, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        keys.append(prev.hex())
    return keys


def indices(pages: list[int]) -> torch.Tensor:
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)])


def backend(url: str, token: str | None = None, pool=None, **cfg) -> KVCacheStorage:
    extra = {"backend_name": "kvcache", "module_path": "kvcache.integrations.sglang", "class_name": "KVCacheStorage",
             "interface_v1": 1, "store": url, "timeout_s": 2.0, **({"token": token} if token else {})}
    b = KVCacheStorage(Config(extra, **cfg), {})
    b.register_mem_pool_host(pool or FakeHostPool())
    OPENED.append(b)
    return b


OPENED: list[KVCacheStorage] = []


@pytest.fixture(autouse=True)
def _close_backends():
    yield
    while OPENED:
        OPENED.pop().close()


@pytest.fixture
def daemon(tmp_path):
    with DaemonProcess(tmp_path / "data", env={"KVCACHE_TOKENS": f"{TOKEN_A}:acme,{TOKEN_B}:globex"}) as d:
        yield d


def test_v1_pages_round_trip_between_processes_pools(daemon):
    src = FakeHostPool()
    src.kv_buffer.normal_()
    keys = page_keys(3)
    a = backend(daemon.url, TOKEN_A, src)
    assert a.batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    assert a.batch_exists(keys + page_keys(1, "other")) == 3
    dst = FakeHostPool()
    b = backend(daemon.url, TOKEN_A, dst)          # another engine process, same tenant
    assert b.batch_get_v1(keys[::-1], indices([5, 6, 7])) == [True] * 3
    for got, want in ((5, 2), (6, 1), (7, 0)):
        assert torch.equal(dst.get_data_page(got * PAGE), src.get_data_page(want * PAGE))
    assert b.batch_get_v1(page_keys(1, "absent"), indices([4])) == [False]
    assert not dst.get_data_page(4 * PAGE).any()


def test_tenants_and_layouts_do_not_share_pages(daemon):
    keys = page_keys(2)
    a = backend(daemon.url, TOKEN_A)
    a.batch_set_v1(keys, indices([0, 1]))
    assert backend(daemon.url, TOKEN_B).batch_exists(keys) == 0
    assert backend(daemon.url, TOKEN_A, FakeHostPool(dtype=torch.float32)).batch_exists(keys) == 0
    assert backend(daemon.url, TOKEN_A, tp_rank=1, tp_size=2).batch_exists(keys) == 0
    assert backend(daemon.url, TOKEN_A).batch_exists(keys) == 2


def test_v2_pools_and_hit_policies(daemon):
    kv, c4, swa = FakeHostPool(), FakeHostPool(dim=4), FakeHostPool(dim=2)
    for p in (kv, c4, swa):
        p.kv_buffer.normal_()
    b = backend(daemon.url, TOKEN_A, kv)
    b.register_mem_host_pool_v2(c4, "deepseek_v4_c4")
    b.register_mem_host_pool_v2(swa, "swa")
    keys = page_keys(4)
    got = b.batch_set_v2([Transfer("kv", keys, indices([0, 1, 2, 3])),
                          Transfer("deepseek_v4_c4", keys[:3], indices([0, 1, 2])),
                          Transfer("swa", keys[3:], indices([3]))])
    assert got == {"kv": [True] * 4, "deepseek_v4_c4": [True] * 3, "swa": [True]}
    r = b.batch_exists_v2(keys, [Transfer("deepseek_v4_c4", keys),
                                 Transfer("swa", keys[3:], hit_policy="trailing_pages")])
    # c4 has 3 pages: the prefix shrinks to 3; swa only restores after page 4: nothing both allow
    assert r.extra_pool_hit_pages == {"kv": 4, "deepseek_v4_c4": 3, "swa": 4}
    assert r.kv_hit_pages == 0 and r.restorable_prefix_pages == []
    r = b.batch_exists_v2(keys, [Transfer("deepseek_v4_c4", keys)])
    assert r.kv_hit_pages == 3 and r.restorable_prefix_pages == [1, 2, 3]
    r = b.batch_exists_v2(keys, [Transfer("deepseek_v4_c4", keys, hit_policy="block_groups", group_pages=2)])
    assert r.kv_hit_pages == 4 and r.extra_pool_hit_pages["deepseek_v4_c4"] == 2     # reports, never gates
    dst = FakeHostPool(dim=4)
    b.register_mem_host_pool_v2(dst, "deepseek_v4_c4")
    assert b.batch_get_v2([Transfer("deepseek_v4_c4", keys, indices([4, 5, 6, 7]))]) == {
        "deepseek_v4_c4": [True, True, True, False]}
    assert torch.equal(dst.get_data_page(5 * PAGE), c4.get_data_page(1 * PAGE))
    assert b.batch_get_v1(keys, indices([4, 5, 6, 7])) == [True] * 4     # v1 and v2 "kv" are one pool


def test_a_store_that_is_down_is_a_miss_never_an_error():
    b = backend(f"http://127.0.0.1:{free_port()}")
    keys = page_keys(2)
    assert b.batch_set_v1(keys, indices([0, 1])) == [False, False]
    assert b.batch_exists(keys) == 0 and b.batch_get_v1(keys, indices([0, 1])) == [False, False]
    assert b.batch_exists_v2(keys, []).kv_hit_pages == 0
    assert b.batch_get(keys, [torch.zeros(8), torch.zeros(8)]) == [None, None]
    assert b.set(keys[0], torch.ones(8)) is False


def test_old_tensor_api(daemon):
    b = backend(daemon.url, TOKEN_A)
    keys = page_keys(2, "old")
    values = [torch.arange(8, dtype=torch.float32), torch.ones(8)]
    assert b.batch_set(keys, values) and b.exists(keys[0])
    out = [torch.zeros(8), torch.zeros(8)]
    assert all(t is o for t, o in zip(b.batch_get(keys, out), out)) and torch.equal(out[0], values[0])
    assert b.get(page_keys(1, "nope")[0], torch.zeros(8)) is None
    assert b.clear() is False


def test_loaded_by_sglangs_own_factory(daemon):
    hicache = pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang (with triton) not installed")
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    assert issubclass(KVCacheStorage, hicache.HiCacheStorage)
    extra = {"backend_name": "kvcache", "module_path": "kvcache.integrations.sglang", "class_name": "KVCacheStorage",
             "store": daemon.url, "token": TOKEN_A}
    cfg = hicache.HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                       is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                       model_name="tiny/model", extra_config=extra)
    pool = FakeHostPool()
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    pool.kv_buffer.normal_()
    keys = page_keys(2, "factory")
    assert b.batch_set_v1(keys, indices([0, 1])) == [True, True]
    transfers = [hicache.PoolTransfer(name=hicache.PoolName.KV, keys=keys, host_indices=indices([2, 3]))]
    assert b.batch_get_v2(transfers) == {"kv": [True, True]}
    r = b.batch_exists_v2(keys, [])
    assert isinstance(r, hicache.PoolTransferResult) and r.kv_hit_pages == 2
