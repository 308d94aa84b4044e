"""ObjectConfig: the object tier's settings (TOML section [object]), and its filesystem.

    [object]
    url = "s3://my-bucket/kvcache"          # or "file:///mnt/shared/kvcache", "/abs/dir"
    pack_mib = 64
    codec = "auto"                           # none | zstd | zstd-shuffle2 | auto
    max_queue_mib = 256
    timeout_s = 10.0
    [object.storage_options]                 # handed to fsspec.filesystem(protocol, ...)
    endpoint_url = "http://127.0.0.1:9000"

fsspec (and s3fs for s3://) are imported only when a tier is opened.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.kvstore.errors import StoreError
from kvcache.tiering.object_codec import CODEC_NAMES

_CODECS = (*CODEC_NAMES, "auto")


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


def make_fs(cfg: ObjectConfig):
    try:
        import fsspec
    except ImportError as e:
        raise StoreError("the object tier needs fsspec (and s3fs for s3://): pip install 'kvcache[object]'") from e
    proto, _ = cfg.split_url()
    opts = dict(cfg.storage_options)
    opts.setdefault("skip_instance_cache", True)   # we tune retries/timeouts on our own instance
    if proto in ("s3", "s3a"):
        ck = dict(opts.get("config_kwargs") or {})
        ck.setdefault("connect_timeout", cfg.timeout_s)
        ck.setdefault("read_timeout", cfg.timeout_s)
        # no hidden botocore retries (a refused connection would sleep up to 1 s): the breaker decides
        ck.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        opts["config_kwargs"] = ck
    try:
        return fsspec.filesystem(proto, **opts)
    except ImportError as e:
        raise StoreError(f"object tier url {cfg.url!r} needs a driver: {e} (for s3://: pip install s3fs)") from e
    except (ValueError, TypeError) as e:
        raise StoreError(f"object tier url {cfg.url!r}: bad storage_options: {e}") from e
