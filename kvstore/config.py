"""StoreConfig: the whole store's settings, loaded from TOML (see configs/store.toml)."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from kvcache.kvstore.retention import RetentionPolicy
from kvcache.kvstore.types import is_real
from kvcache.tiering.config import DramConfig, NvmeConfig, ObjectConfig

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
    gc_interval_s: float = 0.0             # >0: a thread runs the store's collector's steps (needs one)
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
        d = dict(_table("the config", d))
        store = _table("[store]", d.pop("store", {}))
        tiers = {}
        for name, klass in (("dram", DramConfig), ("nvme", NvmeConfig)):
            section = _table(f"[{name}]", d.pop(name, {}))
            if _enabled(name, section):
                tiers[name] = klass(**_sized(klass, {k: v for k, v in section.items() if k != "enabled"}))
            else:
                tiers[name] = None
        section = _table("[object]", d.pop("object", {}))
        if section and _enabled("object", section):
            tiers["object_store"] = ObjectConfig(**_sized(ObjectConfig, {k: v for k, v in section.items()
                                                                         if k != "enabled"}))
        retention = _retention(_table("[retention]", d.pop("retention", {})))
        d.pop("server", None)  # read by `kvcache serve`
        if d:
            raise ValueError(f"unknown config sections {sorted(d)}")
        nested = sorted(set(store) & {"dram", "nvme", "object_store", "retention"})
        if nested:      # they would reach the constructor twice
            raise ValueError(f"[store] holds the store's own settings; {nested} are sections of their own "
                             "([dram], [nvme], [object], [retention])")
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


def _table(name: str, value: Any) -> dict[str, Any]:
    """A section of the config (TOML table, or a JSON object sent to reconfigure) as a dict."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a table of settings, got {type(value).__name__} {str(value)[:40]!r}")
    return dict(value)


def _enabled(name: str, section: Mapping[str, Any]) -> bool:
    on = section.get("enabled", True)
    if not isinstance(on, bool):
        raise ValueError(f"{name}.enabled must be true or false, got {on!r}"[:120])
    return on


def _retention(section: dict[str, Any]) -> RetentionPolicy:
    """[retention] with its [retention.namespaces.<name>] and [retention.tenants.<name>] tables:
    every rule's hours are finite positive numbers (a string or 1e400 would be a rule nobody meant)."""
    rules = {"default": {k: v for k, v in section.items() if k not in ("namespaces", "tenants")}}
    for group in ("namespaces", "tenants"):
        for who, rule in _table(f"[retention.{group}]", section.get(group, {})).items():
            rules[f"{group}.{who}"] = _table(f"[retention.{group}.{who}]", rule)
    for where, rule in rules.items():
        for k, v in rule.items():
            if k in ("ttl_hours", "max_age_hours") and not is_real(v):
                raise ValueError(f"retention {where}.{k} must be a finite number of hours, got {v!r}"[:160])
    return RetentionPolicy.from_dict(section)


_SCALARS = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool), "float": is_real,
            "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
            "dict": lambda v: isinstance(v, Mapping), "None": lambda v: v is None}


def _check_type(klass, name: str, value: Any) -> None:
    """A setting has the type its field declares (`bool | None` allows either); a field typed
    otherwise (a tier's own config, the retention policy) is no setting of this section."""
    kinds = str(_field_types(klass)[name]).replace(" ", "").split("|")
    if not any(k in _SCALARS and _SCALARS[k](value) for k in kinds):
        raise ValueError(f"{klass.__name__}.{name} must be {' or '.join(kinds)}, got {value!r}"[:160])


def _field_types(klass) -> dict[str, str]:
    return {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in fields(klass)}


def _sized(klass, section: Mapping[str, Any]) -> dict[str, Any]:
    """Accept `*_mib`/`*_gib` spellings for `*_bytes` fields; reject unknown keys and values of
    the wrong type (a reconfigure body is as much a client's input as a request is)."""
    names = {f.name for f in fields(klass)}
    out = {}
    for k, v in section.items():
        for suffix, mult in (("_gib", 1 << 30), ("_mib", 1 << 20)):
            if k.endswith(suffix) and k[: -len(suffix)] + "_bytes" in names:
                if not is_real(v) or not 0 <= v <= 1 << 30:
                    raise ValueError(f"{klass.__name__}.{k} must be a number of {suffix[1:].upper()}, got {v!r}"[:160])
                k, v = k[: -len(suffix)] + "_bytes", int(float(v) * mult)
        if k not in names:
            raise ValueError(f"unknown setting {str(k)[:60]!r} for {klass.__name__}; known: {sorted(names)}")
        _check_type(klass, k, v)
        out[k] = v
    return out
