"""Which codec the object tier compresses a record with: as configured, or decided once (auto).

    codec = none | zstd | zstd-shuffle2   that codec, always ("fixed")
    codec = auto
      sampling   zstd (zstd-shuffle2 for layouts of 16-bit values) until auto_sample_bytes were
                 compressed and an upload rate is known (measured, or auto_bandwidth_bytes_s)
      on         it shrinks enough (auto_min_ratio) and compresses faster than the store takes
                 data (compression and upload are pipelined): kept
      off        otherwise: raw from then on

The decision is made once and logged with its numbers; the tier's stats report it (`codec_auto`).
"""

from __future__ import annotations

import logging

from kvcache.kvstore.types import DTYPE_SIZES
from kvcache.tiering.config import ObjectConfig
from kvcache.tiering.object_codec import CODEC_NAMES, ObjCodec

log = logging.getLogger(__name__)


class CodecChoice:
    def __init__(self, config: ObjectConfig):
        self.config = config
        self._state = {"state": "sampling" if config.codec == "auto" else "fixed", "reason": ""}

    @property
    def sampling(self) -> bool:
        return self._state["state"] == "sampling"

    def codec_for(self, layout) -> ObjCodec:
        name = self.config.codec
        if name != "auto":
            return CODEC_NAMES[name]
        if self._state["state"] == "off":
            return ObjCodec.RAW
        two_byte = all(DTYPE_SIZES.get(t.dtype) == 2 for t in layout)
        return ObjCodec.ZSTD_SHUFFLE2 if two_byte else ObjCodec.ZSTD

    def maybe_decide(self, totals: dict, upload_bytes: float, upload_s: float) -> None:
        """Decide once enough was sampled and an upload rate is known. `totals`: the payload
        codec's running totals (PayloadCodec.totals); upload bytes and seconds so far."""
        cfg, t = self.config, totals
        bw = cfg.auto_bandwidth_bytes_s or (upload_bytes / upload_s if upload_s else 0.0)
        if t["raw_bytes"] < cfg.auto_sample_bytes or not bw:
            return
        speed = t["compress_MBps"] * 1e6
        on = t["ratio"] >= cfg.auto_min_ratio and speed >= bw
        self._state = {"state": "on" if on else "off", "ratio": round(t["ratio"], 3),
                       "compress_MBps": round(speed / 1e6, 1), "store_MBps": round(bw / 1e6, 1),
                       "reason": ("compresses enough and faster than the store takes data" if on else
                                  f"ratio < {cfg.auto_min_ratio}" if t["ratio"] < cfg.auto_min_ratio else
                                  "compression is slower than the store")}
        log.info("object tier codec=auto decided: %s", self._state)

    def snapshot(self) -> dict:
        return dict(self._state)
