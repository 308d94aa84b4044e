"""The engine's settings: EngineConfig (the pool, the step budget, compilation, the decode path)
and its `[cache]` section, CacheConfig (prefix reuse and the block store behind it).

configs/engine.toml documents every setting with its default. The model's own config (parsed
from config.json) is engine/model_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CacheConfig:
    """The engine's `[cache]` section (configs/engine-cache.toml documents each field)."""
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
    bandwidth: dict = field(default_factory=lambda: {"dram": 2e9, "nvme": 5e8, "object": 1e8})

    def __post_init__(self):
        if self.mode not in ("replay", "exact"):
            raise ValueError(f"cache mode must be 'replay' or 'exact', got {self.mode!r}")
        if self.snapshot_interval < 1:
            raise ValueError("snapshot_interval must be a positive number of tokens")
        if self.replay_blocks < 0:
            raise ValueError("replay_blocks must be >= 0 (0: enough blocks for 4 sliding windows)")

    @classmethod
    def load(cls, path: str, **overrides) -> "CacheConfig":
        """The [cache] section of a TOML file (configs/engine-cache.toml), then `overrides`."""
        import tomllib
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        section = doc.get("cache")
        if not isinstance(section, dict):
            raise ValueError(f"{path}: no [cache] section (see configs/engine-cache.toml)")
        return cls.from_dict({**section, **{k: v for k, v in overrides.items() if v is not None}})

    @classmethod
    def from_dict(cls, d: dict) -> "CacheConfig":
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"unknown [cache] settings {bad}; known: {sorted(known)}")
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 128            # tokens per KV block: a multiple of every compress ratio the model uses
    num_blocks: int = 512
    max_tokens_per_step: int = 512   # the step's token budget (chunked prefill + decodes)
    max_running: int = 32
    cache: CacheConfig | None = None  # prefix reuse (pool blocks, and a block store when cache.store is set)
    compile: bool = False            # torch.compile the blocks' token-wise phases (engine/compiled.py)
    compile_warmup: bool = True      # with compile: compile every phase variant at start, not mid-request
    # routed experts summed on the device (kernels/grouped_matmul.py), no host round trip per
    # layer; None: on for accelerators with grouped matmuls (bf16 on recent PyTorch), off on the
    # CPU (where the host path is faster). It is set on the model: engines sharing a model share it
    device_experts: bool | None = None
    # a decode step (one token per request, every state in the pool) as tensor ops only, with
    # no per-request Python (engine/decode_plan.py, layers/decode_step.py; compiled: one graph
    # for the whole step); False: the general path (Attention.core) for every step. Set on the
    # model, like device_experts
    block_decode: bool = True
    # CUDA: replay block decode steps as CUDA graphs, one per (batch, pages) bucket
    # (engine/decode_graphs.py); needs block_decode and device_experts
    cuda_graphs: bool = False
