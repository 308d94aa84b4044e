"""The tiers' settings, one class per tier (TOML sections [dram], [nvme], [object] of a store
config: configs/store.toml documents each key; kvstore/config.py reads the file).

    DramConfig    the host-memory arena: capacity, size-class pages, watermarks, eviction,
                  pinning, shared memory and the read directory, admission
    NvmeConfig    segment files: capacity, segment size, fsync policy, O_DIRECT, watermarks,
                  compaction, the space reserved for deletes on a full disk
    ObjectConfig  packs in an object store (fsspec URL): packing, codec, the upload queue,
                  deadlines and the circuit breaker, the bucket's lifecycle rule

    [object]
    url = "s3://my-bucket/kvcache"          # or "file:///mnt/shared/kvcache", "/abs/dir"
    pack_mib = 64
    codec = "auto"                           # none | zstd | zstd-shuffle2 | auto
    max_queue_mib = 256
    timeout_s = 10.0
    [object.storage_options]                 # handed to fsspec.filesystem(protocol, ...)
    endpoint_url = "http://127.0.0.1:9000"
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.policy import NAMES as POLICY_NAMES
from kvcache.tiering.object_codec import CODEC_NAMES

_CODECS = (*CODEC_NAMES, "auto")
_FSYNC_POLICIES = ("always", "interval", "never")


@dataclass(frozen=True)
class DramConfig:
    capacity_bytes: int = 1 << 30
    page_bytes: int = 16 << 20
    high_watermark: float = 0.98   # above this share of the arena, evict ...
    low_watermark: float = 0.95    # ... down to this (what is held on average sets the hit rate)
    eviction: str = "duel"         # an eviction order of kvcache/policy: "lru", "fifo", "s3fifo" or "duel"
    eviction_small_fraction: float | None = None  # s3fifo/duel: S3-FIFO's small queue (None: the default)
    eviction_decay: float = 0.999  # duel: how fast old wins fade (~1/(1-decay) lookups of memory)
    pin_memory: str = "auto"       # "auto" | "on" | "off"
    prefault: bool = True          # touch the arena at start-up, not on the first puts
    shared_memory: bool | None = None  # local clients map the arena (None: on in `kvcache serve`)
    admission: str = "always"      # write-through puts: "always" cache in DRAM, or "second-hit": only a
                                   # block seen before (reads always admit); one-off blocks then never
                                   # evict reused ones from a small DRAM (see benchmarks/README, replay)
    admission_memory: int = 262144  # "second-hit": how many recently refused keys are remembered
    read_directory: bool = True    # with shared_memory: publish where put and leased blocks sit so local
                                   # clients read them without a round trip (kvstore/shm_directory.py)
    tenants: dict = field(default_factory=dict)  # [dram.tenants.<name>] share = 0.3, eviction = "duel": the
                                   # arena share a tenant keeps from the others' puts (tiering/dram_shares.py)

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("need 0 < dram.low_watermark <= dram.high_watermark <= 1")
        if self.eviction not in POLICY_NAMES:
            raise ValueError(f"dram.eviction must be one of {', '.join(POLICY_NAMES)}, got {self.eviction!r}")
        if self.eviction_small_fraction is not None and not 0 < self.eviction_small_fraction < 1:
            raise ValueError(f"dram.eviction_small_fraction must be in (0, 1), got {self.eviction_small_fraction}")
        if not 0 < self.eviction_decay < 1:
            raise ValueError(f"dram.eviction_decay must be in (0, 1), got {self.eviction_decay}")
        if self.pin_memory not in ("auto", "on", "off"):
            raise ValueError(f"dram.pin_memory must be auto, on or off, got {self.pin_memory!r}")
        if self.admission not in ("always", "second-hit") or self.admission_memory < 1:
            raise ValueError(f"dram.admission must be always or second-hit (with admission_memory >= 1), "
                             f"got {self.admission!r}")
        self.tenant_shares()

    def tenant_shares(self) -> dict[str, tuple[float, str]]:
        """[dram.tenants]: each listed tenant's (share, eviction order), checked; the other tenants
        share what is left, under dram.eviction."""
        out: dict[str, tuple[float, str]] = {}
        for name, t in self.tenants.items():
            where = f"dram.tenants.{str(name)[:40]}"
            if not isinstance(t, dict) or not name or not isinstance(name, str):
                raise ValueError(f"{where} must be a table (share = 0.3, eviction = \"duel\") named by a tenant")
            unknown = sorted(set(t) - {"share", "eviction"})
            if unknown:
                raise ValueError(f"{where}: unknown settings {unknown}; known: share, eviction")
            share, eviction = t.get("share"), t.get("eviction", self.eviction)
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
                raise ValueError(f"{where}.share must be a fraction of the arena in (0, 1], got {share!r}"[:160])
            if eviction not in POLICY_NAMES:
                raise ValueError(f"{where}.eviction must be one of {', '.join(POLICY_NAMES)}, got {eviction!r}"[:160])
            out[name] = (float(share), eviction)
        total = sum(s for s, _ in out.values())
        if total > 1 + 1e-9:
            raise ValueError(f"the dram.tenants shares add up to {total:.3g}: they are fractions of one arena, "
                             "at most 1 together")
        return out


@dataclass(frozen=True)
class NvmeConfig:
    capacity_bytes: int = 64 << 30
    segment_bytes: int = 256 << 20
    fsync: str = "always"          # "always": durable on return; "interval": every fsync_interval_s; "never"
    fsync_interval_s: float = 1.0
    o_direct: bool = False
    high_watermark: float = 0.98   # segment files over this share of capacity_bytes: evict ...
    low_watermark: float = 0.95    # ... down to this (sampled-lru wants more room: 0.95 / 0.85)
    compact_below: float = 0.5     # compact a sealed segment whose live fraction drops below this
    eviction: str = "segment-lru"  # "segment-lru": the oldest segments drop their cold blocks, then go;
                                   # "sampled-lru": oldest of random samples (gc/segment_eviction.py)
    reserve_bytes: int = 4 << 20   # kept free for deletes on a full disk (tiering/space_reserve.py)

    def __post_init__(self) -> None:
        if self.fsync not in _FSYNC_POLICIES:
            raise ValueError(f"nvme.fsync must be one of {_FSYNC_POLICIES}, got {self.fsync!r}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("need 0 < nvme.low_watermark <= nvme.high_watermark <= 1")
        if self.segment_bytes < 1 << 20:
            raise ValueError("nvme.segment_bytes must be at least 1 MiB")
        if self.eviction not in ("segment-lru", "sampled-lru"):
            raise ValueError(f"nvme.eviction must be segment-lru or sampled-lru, got {self.eviction!r}")
        if self.reserve_bytes < 0:
            raise ValueError("nvme.reserve_bytes must be >= 0")


@dataclass(frozen=True)
class ObjectConfig:
    url: str
    storage_options: dict = field(default_factory=dict, repr=False)  # to fsspec.filesystem(); may hold secrets
    pack_bytes: int = 64 << 20            # seal a pack at this size ...
    pack_max_blocks: int = 8192           # ... or this many records
    pack_linger_s: float = 2.0            # ... or when its first record waited this long
    codec: str = "none"                   # none | zstd | zstd-shuffle2 | auto
    zstd_level: int = 1
    auto_sample_bytes: int = 16 << 20     # codec=auto: compress this much, then decide
    auto_min_ratio: float = 1.1           # ... keep compressing only at this ratio or better
    auto_bandwidth_bytes_s: float = 0.0   # ... and faster than this (0: the measured upload rate)
    max_queue_bytes: int = 256 << 20      # write-back memory bound (raw payload bytes)
    queue_full: str = "drop"              # drop (the store never waits on S3) | block (up to enqueue_timeout_s)
    enqueue_timeout_s: float = 10.0
    on_outage: str = "drop"               # drop | hold (keep queued within the bound, retry)
    upload_workers: int = 2
    timeout_s: float = 10.0               # deadline of every object-store call ...
    min_bandwidth_bytes_s: float = 8 << 20  # ... plus size / this for pack uploads and GETs
    write_retries: int = 1
    breaker_failures: int = 5
    breaker_cooldown_s: float = 30.0
    close_timeout_s: float = 30.0         # close() flushes this long, then drops what is left
    capacity_bytes: int = 0               # reported by usage(); 0 = unbounded
    index_tail_bytes: int = 64 << 10      # rebuild reads this much of a pack's tail first
    lifecycle_days: float = 0.0           # the bucket's expiration rule for this prefix, if any (0: none)

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"object.{msg}")
        proto, path = self.split_url()
        need(bool(path), f"url must name a location, got {self.url!r}")
        if proto in ("s3", "s3a"):
            need(len(path.split("/")[0]) >= 3, f"url needs a bucket name of 3+ characters: {self.url!r}")
        if proto in ("file", "local"):
            need(path.startswith("/"), f"url must be an absolute path for local storage: {self.url!r}")
        need(isinstance(self.storage_options, dict), "storage_options must be a table/dict")
        need(self.codec in _CODECS, f"codec must be one of {_CODECS}, got {self.codec!r}")
        need(self.queue_full in ("block", "drop"), f"queue_full must be block or drop, got {self.queue_full!r}")
        need(self.on_outage in ("drop", "hold"), f"on_outage must be drop or hold, got {self.on_outage!r}")
        need(self.pack_bytes >= 64 << 10, "pack_bytes must be at least 64 KiB")
        need(self.pack_max_blocks >= 1, "pack_max_blocks must be at least 1")
        need(self.max_queue_bytes >= self.pack_bytes,
             "max_queue_bytes must be at least pack_bytes (one pack is built in memory)")
        need(self.timeout_s > 0 and self.min_bandwidth_bytes_s > 0, "timeout_s and min_bandwidth_bytes_s must be > 0")
        need(self.breaker_failures >= 1 and self.breaker_cooldown_s >= 0,
             "breaker_failures must be >= 1 and breaker_cooldown_s >= 0")
        need(self.upload_workers >= 1 and self.write_retries >= 0,
             "upload_workers must be >= 1 and write_retries >= 0")
        need(self.auto_min_ratio >= 1.0 and self.auto_sample_bytes > 0,
             "auto_min_ratio must be >= 1 and auto_sample_bytes > 0")
        need(1 <= self.zstd_level <= 22, "zstd_level must be 1-22")
        need(self.lifecycle_days >= 0, "lifecycle_days must be >= 0 (0: the bucket has no expiration rule)")

    def split_url(self) -> tuple[str, str]:
        if "://" in self.url:
            proto, path = self.url.split("://", 1)
            return proto.lower(), path
        return "file", self.url
