"""The engine's settings: EngineConfig (the pool, the step budget, compilation, the decode path)
and its `[cache]` section, CacheConfig (prefix reuse and the block store behind it).

configs/engine.toml documents every setting with its default; `EngineConfig.load(path)` reads
such a file, strictly: an unknown key, a value of the wrong type or a bad value is an
EngineConfigError naming the file and the key (in a [cache] section with enabled = false too:
`EngineConfig.load_with_cache` also gives that section's settings, for a flag that turns it on).
The model's own config (parsed from config.json) is engine/model_config.py.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from kvcache.kvstore.types import STORE_TIERS, TierName
from kvcache.policy import NAMES as POLICY_NAMES


@dataclass(frozen=True)
class CacheConfig:
    """The engine's `[cache]` section (configs/engine.toml documents each field)."""
    store: str = ""                  # open_store spec: a directory, a store TOML, http://host:port, unix:///sock
    token: str | None = None         # bearer token for a daemon (else $KVCACHE_TOKEN)
    model_id: str = ""               # names the weights in block keys (e.g. "v4.1-flash@flash-1017"); empty: a
                                     #   checksum of the weights at start (a store never mixes two models' KV)
    mode: str = "replay"             # replay: rebuild windows/carry by recomputing the last blocks of a hit
    replay_blocks: int = 0           #   (approximate; 0 = 4 sliding windows); exact: resume from a tail snapshot
    save: bool = True                # save newly computed blocks (and snapshots in exact mode)
    cost_model: bool = True          # skip a tier's blocks when loading them is slower than recomputing
    pin_ttl_s: float = 10.0          # soft pins taken for a fetch (they lapse on their own after this)
    max_pending_save_bytes: int = 512 << 20
    snapshot_interval: int = 512     # exact mode: prefill chunks end on multiples of this (tokens), and each
                                     #   such point gets a snapshot; a multiple of the block size
    snapshot_memory_bytes: int = 256 << 20   # recent snapshots kept in the engine (the HBM tier of exact mode)
    # first guesses of each tier's load bandwidth (bytes/s), replaced by measurements as loads happen
    bandwidth: dict = field(default_factory=lambda: {TierName.DRAM: 2e9, TierName.NVME: 5e8, TierName.OBJECT: 1e8})

    def __post_init__(self):
        if self.mode not in ("replay", "exact"):
            raise ValueError(f"cache mode must be 'replay' or 'exact', got {self.mode!r}")
        if self.snapshot_interval < 1:
            raise ValueError("snapshot_interval must be a positive number of tokens")
        if self.replay_blocks < 0:
            raise ValueError("replay_blocks must be >= 0 (0: enough blocks for 4 sliding windows)")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's `[engine]` section, and its cache (configs/engine.toml documents each field)."""
    block_size: int = 128            # tokens per KV block: a multiple of every compress ratio the model uses
    num_blocks: int = 512
    pool_eviction: str = "lru"       # which cached pool block is reused first: a kvcache/policy order
    max_tokens_per_step: int = 512   # the step's token budget (chunked prefill + decodes)
    max_running: int = 32
    cache: CacheConfig | None = None  # prefix reuse (pool blocks, and a block store when cache.store is set)
    compile: bool = False            # torch.compile the layers' token-wise phases (engine/compiled.py)
    compile_warmup: bool = True      # with compile: compile every phase variant at start, not mid-request
    # routed experts summed on the device (kernels/grouped_matmul.py), no host round trip per
    # layer; None: on for accelerators with grouped matmuls (bf16 on recent PyTorch), off on the
    # CPU (where the host path is faster). It is set on the model: engines sharing a model share it
    device_experts: bool | None = None
    # a decode step (one token per request, every state in the pool) as tensor ops only, with
    # no per-request Python (engine/decode_plan.py, layers/decode_step.py; compiled: one graph
    # for the whole step); False: the general path (Attention.core) for every step. None: on when
    # compiled or on accelerators; off for eager steps on the CPU, where the general path is
    # faster (v4-small eager: 55 / 152 / 249 tok/s at batch 1 / 4 / 8 against 48 / 128 / 190
    # planned). Set on the model, like device_experts
    planned_decode: bool | None = None
    # CUDA: replay planned decode steps as CUDA graphs, one per (batch, blocks) bucket
    # (engine/decode_graphs.py); needs planned_decode and device_experts
    cuda_graphs: bool = False
    # speculative decoding (engine/speculative): "" off, "mtp" (V4's MTP layer chained num_draft
    # times), "dspark" (the DSpark drafter; how many of its drafts a step verifies is chosen from
    # their confidences and the measured step cost); lossless either way
    speculative: str = ""
    num_draft: int = 0               # drafts per request and step; 0: 3 for mtp, the draft block for dspark
    # overlapped steps (engine/overlap.py): the next step is planned on a helper thread while
    # this one's forward runs, with placeholders for the tokens not sampled yet; the same
    # tokens wherever the model's numerics do not depend on which requests share a step (the
    # sampling draws never do). None: on for accelerators (the host's planning hidden), off on
    # the CPU
    async_scheduling: bool | None = None

    def __post_init__(self):
        if self.pool_eviction not in POLICY_NAMES:
            raise ValueError(f"pool_eviction must be one of {', '.join(POLICY_NAMES)}, got {self.pool_eviction!r}")
        if self.speculative not in ("", "mtp", "dspark"):
            raise ValueError(f"speculative must be '', 'mtp' or 'dspark', got {self.speculative!r}")
        if self.speculative and self.cuda_graphs:
            raise ValueError("speculative decoding runs every step on the general path: cuda_graphs replays "
                             "planned decode steps only; turn one of them off")
        if self.num_draft < 0:
            raise ValueError(f"num_draft must be >= 0 (0: the method's default), got {self.num_draft}")

    @classmethod
    def load(cls, path: str) -> "EngineConfig":
        """The settings of a TOML file like configs/engine.toml: [engine], and [cache] (absent, or
        enabled = false: no prefix reuse). Every key is optional and defaults as here."""
        return cls.load_with_cache(path)[0]

    @classmethod
    def load_with_cache(cls, path: str) -> tuple["EngineConfig", CacheConfig | None]:
        """load's settings, and the file's [cache] settings even when it says enabled = false
        (None: no [cache] section): what a flag that turns the cache on (--cache) starts from."""
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except (FileNotFoundError, IsADirectoryError):
            raise EngineConfigError(f"engine config {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise EngineConfigError(f"engine config {path} is not valid TOML: {e}") from None
        try:
            return cls._parts(raw)
        except EngineConfigError as e:
            raise EngineConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EngineConfig":
        """The settings of a parsed engine TOML (sections as tables)."""
        return cls._parts(d)[0]

    @classmethod
    def _parts(cls, d: Mapping[str, Any]) -> tuple["EngineConfig", CacheConfig | None]:
        """The settings, and the [cache] section's (checked whether or not it is enabled)."""
        unknown = sorted(set(d) - {"engine", "cache"} - DAEMON_SECTIONS)
        if unknown:
            raise EngineConfigError(f"unknown sections {unknown}; an engine config has [engine] and [cache] "
                                    "(beside the daemon's, when `kvcache serve --model` shares the file)")
        settings = _settings(cls, "engine", _table("engine", d.get("engine", {})))
        enabled, cache = _cache(_table("cache", d["cache"])) if "cache" in d else (False, None)
        return _build(cls, "engine", {**settings, "cache": cache if enabled else None}), cache


class EngineConfigError(ValueError):
    """An engine config that cannot be used; the message names the file and the key."""


# the daemon's sections: `kvcache serve --model --config FILE` reads one file for both, each its own
DAEMON_SECTIONS = frozenset({"store", "server", "dram", "nvme", "object", "retention"})
_AUTO = {"device_experts", "async_scheduling", "planned_decode"}   # `bool | None` settings: "auto" in TOML is None
_POSITIVE = {"block_size", "num_blocks", "max_tokens_per_step", "max_running"}
_TIERS = [str(t) for t in STORE_TIERS]  # the tiers a cache's bandwidth guesses name
_KINDS = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
          "dict": lambda v: isinstance(v, Mapping)}


def _cache(section: dict[str, Any]) -> tuple[bool, CacheConfig]:
    """Whether [cache] is enabled, and its settings (built either way: --cache turns a disabled
    section on with the file's settings, so they are checked either way)."""
    enabled = section.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise EngineConfigError(f"[cache].enabled must be true or false, got {enabled!r}"[:160])
    settings = _settings(CacheConfig, "cache", section)
    if "bandwidth" in settings:          # a tier left out keeps its first guess
        settings["bandwidth"] = {**CacheConfig().bandwidth, **_bandwidth(settings["bandwidth"])}
    return enabled, _build(CacheConfig, "cache", settings)


def _bandwidth(table: Mapping[str, Any]) -> dict[TierName, float]:
    for tier, v in table.items():
        if tier not in _TIERS:
            raise EngineConfigError(f"unknown tier {str(tier)[:40]!r} in [cache.bandwidth]; known: {_TIERS}")
        if not _KINDS["float"](v) or v <= 0:
            raise EngineConfigError(f"[cache.bandwidth].{tier} must be a positive number of bytes/s, got {v!r}"[:160])
    return {TierName(tier): float(v) for tier, v in table.items()}


def _table(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise EngineConfigError(f"[{name}] must be a table of settings, got {type(value).__name__} {str(value)[:40]!r}")
    return dict(value)


def _settings(klass, section: str, table: Mapping[str, Any]) -> dict[str, Any]:
    """`table`'s keys as `klass` fields, each checked against its declared type: `*_mib`/`*_gib`
    spell `*_bytes` fields; a field typed as another config (the engine's cache) is no key."""
    types = {f.name: str(f.type).replace(" ", "").split("|") for f in fields(klass)}
    out = {}
    for key, value in table.items():
        name, value = _sized(section, key, value, types)
        kinds = types.get(name)
        if kinds is None or not any(k in _KINDS for k in kinds):
            known = sorted(n for n, ks in types.items() if any(k in _KINDS for k in ks))
            raise EngineConfigError(f"unknown setting [{section}].{str(key)[:60]}; known: {known}")
        if name in _AUTO and value == "auto":
            value = None
        elif not any(_KINDS[k](value) for k in kinds if k in _KINDS):
            want = " or ".join(['"auto"'] * (name in _AUTO) + [k for k in kinds if k in _KINDS])
            raise EngineConfigError(f"[{section}].{key} must be {want}, got {value!r}"[:160])
        if "float" in kinds and _KINDS["int"](value):
            value = float(value)
        if name in _POSITIVE and value < 1:
            raise EngineConfigError(f"[{section}].{key} must be at least 1, got {value!r}")
        out[name] = value
    return out


def _sized(section: str, key: str, value: Any, types: Mapping[str, list[str]]) -> tuple[str, Any]:
    for suffix, mult in (("_gib", 1 << 30), ("_mib", 1 << 20)):
        name = key[: -len(suffix)] + "_bytes"
        if key.endswith(suffix) and name in types:
            if not _KINDS["float"](value) or not 0 <= value <= 1 << 30:
                unit = suffix[1:].upper()
                raise EngineConfigError(f"[{section}].{key} must be a number of {unit}, got {value!r}"[:160])
            return name, int(value * mult)
    return key, value


def _build(klass, section: str, settings: dict[str, Any]):
    """`klass(**settings)`, its own checks (a cache mode, an interval) said as the section's."""
    try:
        return klass(**settings)
    except ValueError as e:
        raise EngineConfigError(f"[{section}]: {e}") from None
