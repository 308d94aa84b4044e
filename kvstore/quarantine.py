"""What the store does with a copy that failed verification, or whose pack has vanished.

    NVMe copy corrupt     forgotten; the block too unless an object copy remains (it keeps
                          serving); a line in quarantine.jsonl
    object copy corrupt   that copy forgotten; the other tiers' copies stay
    pack vanished         (a bucket lifecycle rule) the copy forgotten; GC forgets the rest of
                          the pack's copies in one go

Every callback runs on a read's path, which answers a miss whatever the callback meets. A mixin
of BlockStore (kvstore/store.py), whose index, lock, DRAM tier and counters it uses; not meant to
be used on its own.
"""

from __future__ import annotations

import functools
import json
import logging
import os

from kvcache.kvstore.types import Tier
from kvcache.tiering.base import Placement

log = logging.getLogger(__name__)


def _recorded_if_possible(callback):
    """For the callbacks a read makes when a copy fails verification or has vanished: the read
    answers a miss whatever they meet (a full disk for quarantine.jsonl, a full index map). The
    copy is still never served: the next read verifies it again."""
    @functools.wraps(callback)
    def wrapped(self, key: bytes, placement: Placement, reason: str) -> None:
        try:
            callback(self, key, placement, reason)
        except Exception as e:                  # noqa: BLE001 (see above)
            self.stats_counters["quarantine_errors"] += 1
            log.error("could not record the bad copy of %s (%s): %s: %s", key.hex(), reason, type(e).__name__, e)
    return wrapped


class StoreQuarantine:
    @_recorded_if_possible
    def _object_vanished(self, key: bytes, placement: Placement, reason: str) -> None:
        """The pack holding a copy was deleted outside kvcache (a bucket lifecycle rule): forget
        the copy; GC forgets the rest of that pack's copies in one go."""
        log.info("object copy of %s forgotten: %s", key.hex(), reason)
        self.index.commit(object_drops={key: placement})
        self.stats_counters["object_vanished"] += 1

    @_recorded_if_possible
    def _quarantine_object(self, key: bytes, placement: Placement, reason: str) -> None:
        """A pack record failed verification: forget that copy (other tiers' copies stay)."""
        log.error("quarantined object copy of %s: %s", key.hex(), reason)
        self.index.commit(object_drops={key: placement}, counters={"quarantined": 1})
        self.stats_counters["quarantined"] += 1

    @_recorded_if_possible
    def _quarantine(self, key: bytes, placement: Placement, reason: str) -> None:
        """An NVMe copy failed verification: forget it (and the block, unless an object copy
        remains), count it, log it. Never served.
        A block that compaction has just moved elsewhere is left alone (the reader retries)."""
        with self._lock:
            meta = self.index.get(key)
            if meta is None or (meta.segment_id, meta.offset) != (placement.segment_id, placement.offset):
                return
            log.error("quarantined block %s: %s", key.hex(), reason)
            if self.index.object_location(key) is not None:     # the object copy is intact: keep it
                meta.residency &= ~Tier.NVME
                self.index.commit({key: meta}, counters={"quarantined": 1})
            else:
                self.index.commit(deletes=[key], counters={"quarantined": 1})
                self._drop_dram_copies([key])    # no index entry: nothing may serve or hold it
            self.stats_counters["quarantined"] += 1
            line = json.dumps({"time": self.clock(), "key": key.hex(), "reason": reason})
            with open(os.path.join(self.config.data_dir, "quarantine.jsonl"), "a") as f:
                f.write(line + "\n")
