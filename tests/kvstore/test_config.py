"""TOML configs: the shipped example loads, sizes and overrides parse, mistakes are named."""

import os

import pytest

from kvcache.kvstore.retention import HOUR
from kvcache.kvstore.config import StoreConfig

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "store.toml")


def test_shipped_example_is_the_defaults(tmp_path):
    cfg = StoreConfig.load(EXAMPLE, str(tmp_path))
    assert cfg == StoreConfig(str(tmp_path))


def test_sizes_overrides_and_disabled_tiers(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[store]\ndata_dir = "%s"\nwrite_policy = "write-back"\n'
                 '[dram]\ncapacity_mib = 64\n[nvme]\nsegment_mib = 8\nfsync = "interval"\n'
                 '[retention]\nttl_hours = 100\n[retention.tenants.acme]\nttl_hours = 5\n' % tmp_path)
    cfg = StoreConfig.load(str(p))
    assert cfg.dram.capacity_bytes == 64 << 20 and cfg.nvme.segment_bytes == 8 << 20
    assert cfg.retention.default.ttl_s == 100 * HOUR and cfg.retention.tenants["acme"].ttl_s == 5 * HOUR
    p.write_text("[dram]\nenabled = false\n")
    assert StoreConfig.load(str(p), str(tmp_path)).dram is None


@pytest.mark.parametrize("text, match", [
    ("[dram]\ncapacity_gigs = 1\n", "unknown setting 'capacity_gigs'"),
    ("[nvme]\nfsync = 'sometimes'\n", "nvme.fsync"),
    ("[cache]\n", "unknown config sections"),
    ("[dram]\nenabled = false\n[nvme]\nenabled = false\n", "at least one tier"),
    ("[store]\nwrite_policy = 'write-back'\n[nvme]\nenabled = false\n", "write-back needs"),
    ("[dram]\nhigh_watermark = 0.5\nlow_watermark = 0.9\n", "watermark"),
    ("[retention]\nttl_hours = -1\n", "positive"),
    ("[dram\n", "not valid TOML"),
])
def test_mistakes_are_named(tmp_path, text, match):
    p = tmp_path / "c.toml"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        StoreConfig.load(str(p), str(tmp_path))


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        StoreConfig.load(str(tmp_path / "none.toml"), str(tmp_path))


def test_shipped_example_server_section_is_the_defaults():
    import tomllib
    from kvcache.server.config import ServerConfig
    with open(EXAMPLE, "rb") as f:
        assert ServerConfig.from_dict(tomllib.load(f)["server"], env={}) == ServerConfig()


def test_object_section(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(f'[object]\nurl = "file://{tmp_path}/b"\npack_mib = 8\ncodec = "zstd-shuffle2"\n'
                 '[object.storage_options]\nauto_mkdir = true\n')
    cfg = StoreConfig.load(str(p), str(tmp_path))
    assert cfg.object_store.pack_bytes == 8 << 20 and cfg.object_store.codec == "zstd-shuffle2"
    assert cfg.object_store.storage_options == {"auto_mkdir": True}
    assert StoreConfig.load(EXAMPLE, str(tmp_path)).object_store is None
