"""namespaces.json: the namespace descriptors kept beside the NVMe tier's segments.

An index rebuilt from the segments (kvstore/rebuild.py) learns from it which namespaces
exist. It is written whole or not at all: a new file is written and fsynced beside the old
one, renamed over it, and the directory fsynced; a failed write leaves the old file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

from kvcache.kvstore.durable import replace_synced

log = logging.getLogger(__name__)
NAME = "namespaces.json"


def save(root: str, descriptors: dict[str, dict]) -> None:
    """Replace `root`/namespaces.json with `descriptors`; an OSError leaves the old file."""
    path = os.path.join(root, NAME)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(descriptors, f, sort_keys=True, indent=1)
        replace_synced(tmp, path, sync_dir=True)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load(root: str) -> dict[str, dict]:
    """Descriptors saved in `root`; anything malformed is skipped with an error log."""
    try:
        with open(os.path.join(root, NAME)) as f:
            raw = json.load(f)
    except FileNotFoundError:
        return {}
    except (ValueError, OSError) as e:
        log.error("%s in %s is unreadable (%s); register namespaces again", NAME, root, e)
        return {}
    if not isinstance(raw, dict):
        log.error("%s in %s is not an object; register namespaces again", NAME, root)
        return {}
    return {k: v for k, v in raw.items() if isinstance(v, dict)}
