"""StoreConfig: the whole store's settings, loaded from TOML (see configs/store.toml)."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from kvcache.gc.retention import RetentionPolicy
from kvcache.tiering.dram import DramConfig
from kvcache.tiering.nvme import NvmeConfig
from kvcache.tiering.object_config import ObjectConfig

_WRITE_POLICIES = ("write-through", "write-back")


@dataclass(frozen=True)
class StoreConfig:
    data_dir: str
    dram: DramConfig | None = field(default_factory=DramConfig)
    nvme: NvmeConfig | None = field(default_factory=NvmeConfig)
    object_store: ObjectConfig | None = None   # [object]: packs in S3 or a shared directory, below NVMe
    write_policy: str = "write-through"   # write-back: acknowledge from DRAM, demote on eviction/flush
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    index_map_bytes: int = 64 << 30        # LMDB map size (virtual; the file grows as needed)
    touch_flush_s: float = 1.0             # how often buffered access times reach the index
    gc_interval_s: float = 0.0             # >0: a background thread runs bounded GC steps
    event_log: bool = True                 # `kvcache serve` keeps store events in events_dir (`kvcache report`)

    def __post_init__(self) -> None:
        if self.write_policy not in _WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {_WRITE_POLICIES}, got {self.write_policy!r}")
        if self.dram is None and self.nvme is None:
            raise ValueError("configure at least one tier: [dram] or [nvme]")
        if self.write_policy == "write-back" and (self.dram is None or self.nvme is None):
            raise ValueError("write-back needs both a DRAM and an NVMe tier")
        if self.object_store is not None and self.nvme is None:
            raise ValueError("the object tier sits below NVMe: configure [nvme] too")

    @property
    def index_dir(self) -> str:
        return os.path.join(self.data_dir, "index")

    @property
    def nvme_dir(self) -> str:
        return os.path.join(self.data_dir, "nvme")

    @property
    def events_dir(self) -> str:
        return os.path.join(self.data_dir, "events")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], data_dir: str | None = None) -> "StoreConfig":
        d = dict(d)
        store = dict(d.pop("store", {}))
        tiers = {}
        for name, klass in (("dram", DramConfig), ("nvme", NvmeConfig)):
            section = d.pop(name, {})
            if section.get("enabled", True) is False:
                tiers[name] = None
            else:
                tiers[name] = klass(**_sized(klass, {k: v for k, v in section.items() if k != "enabled"}))
        section = dict(d.pop("object", {}))
        if section and section.pop("enabled", True) is not False:
            tiers["object_store"] = ObjectConfig(**_sized(ObjectConfig, section))
        retention = RetentionPolicy.from_dict(d.pop("retention", {}))
        d.pop("server", None)  # read by `kvcache serve`
        if d:
            raise ValueError(f"unknown config sections {sorted(d)}")
        dd = data_dir or store.pop("data_dir", None)
        store.pop("data_dir", None)
        if not dd:
            raise ValueError("set store.data_dir in the config or pass a data directory")
        return cls(data_dir=os.path.expanduser(dd), retention=retention, **tiers, **_sized(cls, store))

    @classmethod
    def load(cls, path: str, data_dir: str | None = None) -> "StoreConfig":
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except FileNotFoundError:
            raise ValueError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from None
        return cls.from_dict(raw, data_dir)


def _sized(klass, section: Mapping[str, Any]) -> dict[str, Any]:
    """Accept `*_mib`/`*_gib` spellings for `*_bytes` fields; reject unknown keys."""
    names = {f.name for f in fields(klass)}
    out = {}
    for k, v in section.items():
        for suffix, mult in (("_gib", 1 << 30), ("_mib", 1 << 20)):
            if k.endswith(suffix) and k[: -len(suffix)] + "_bytes" in names:
                k, v = k[: -len(suffix)] + "_bytes", int(float(v) * mult)
        if k not in names:
            raise ValueError(f"unknown setting {k!r} for {klass.__name__}; known: {sorted(names)}")
        out[k] = v
    return out
