"""Retention policies as data.

A block expires at   min(last_access + ttl, created + max_age)   unless it is pinned
(hard pin, or soft pin whose TTL has not run out). The rule used for a block is the most
specific one configured:  tenant override  >  namespace override  >  default.
A block put with an explicit TTL expires at created + that TTL instead (pins still win).
Defaults: 72 hours from last access, no maximum age.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

from kvcache.kvstore.types import BlockMeta

_EXPIRES_AT, _CREATED = operator.attrgetter("expires_at"), operator.attrgetter("created")

HOUR = 3600.0


@dataclass(frozen=True)
class RetentionRule:
    ttl_s: float = 72 * HOUR
    max_age_s: float | None = None

    def __post_init__(self) -> None:
        if self.ttl_s <= 0:
            raise ValueError(f"retention ttl must be positive, got {self.ttl_s}")
        if self.max_age_s is not None and self.max_age_s <= 0:
            raise ValueError(f"retention max_age must be positive, got {self.max_age_s}")

    @classmethod
    def from_dict(cls, d: Mapping) -> "RetentionRule":
        unknown = set(d) - {"ttl_hours", "max_age_hours"}
        if unknown:
            raise ValueError(f"unknown retention keys {sorted(unknown)}; use ttl_hours and max_age_hours")
        max_age = d.get("max_age_hours")
        return cls(float(d.get("ttl_hours", 72)) * HOUR, None if max_age is None else float(max_age) * HOUR)


@dataclass(frozen=True)
class RetentionPolicy:
    default: RetentionRule = RetentionRule()
    namespaces: Mapping[str, RetentionRule] = field(default_factory=dict)
    tenants: Mapping[str, RetentionRule] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "namespaces", MappingProxyType(dict(self.namespaces)))
        object.__setattr__(self, "tenants", MappingProxyType(dict(self.tenants)))
        rules = [self.default, *self.namespaces.values(), *self.tenants.values()]
        # no rule keeps a block less than this: what `surely_live` checks without finding the rule
        object.__setattr__(self, "_shortest", (min(r.ttl_s for r in rules),
                                               min(r.max_age_s or math.inf for r in rules)))

    def surely_live(self, meta: BlockMeta, now: float) -> bool:
        """True when `meta` is live at `now` under any rule (pinned, or younger than the shortest
        ttl and max age configured): the read path's check, a fraction of `is_expired`'s cost.
        False says nothing: ask `is_expired`."""
        if meta.hard_pins or meta.soft_pin_until > now:
            return True
        if meta.expires_at > 0:
            return now < meta.expires_at
        ttl, age = self._shortest
        return now < max(meta.last_access, meta.created) + ttl and now < meta.created + age

    def surely_live_all(self, metas: Sequence[BlockMeta], now: float) -> bool:
        """True when every one of `metas` is surely live because it is younger than the shortest
        ttl and max age and has no deadline of its own: `surely_live` for a batch, its loops in C.
        False says nothing about any one of them."""
        if not metas:
            return True
        ttl, age = self._shortest
        return not any(map(_EXPIRES_AT, metas)) and now < min(map(_CREATED, metas)) + min(ttl, age)

    def rule(self, namespace_name: str, tenant: str) -> RetentionRule:
        if tenant and tenant in self.tenants:
            return self.tenants[tenant]
        if namespace_name and namespace_name in self.namespaces:
            return self.namespaces[namespace_name]
        return self.default

    def expires_at(self, meta: BlockMeta, namespace_name: str = "") -> float:
        if meta.expires_at > 0:  # a deadline the writer chose for this block
            return meta.expires_at
        rule = self.rule(namespace_name, meta.tenant)
        at = max(meta.last_access, meta.created) + rule.ttl_s
        if rule.max_age_s is not None:
            at = min(at, meta.created + rule.max_age_s)
        return at

    def is_expired(self, meta: BlockMeta, now: float, namespace_name: str = "") -> bool:
        if meta.hard_pins or meta.soft_pin_until > now:
            return False
        return now >= self.expires_at(meta, namespace_name)

    @classmethod
    def from_dict(cls, d: Mapping) -> "RetentionPolicy":
        d = dict(d)
        ns = {k: RetentionRule.from_dict(v) for k, v in d.pop("namespaces", {}).items()}
        tenants = {k: RetentionRule.from_dict(v) for k, v in d.pop("tenants", {}).items()}
        return cls(RetentionRule.from_dict(d), ns, tenants)
