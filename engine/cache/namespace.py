"""The namespace an engine keys its blocks under."""

from __future__ import annotations

import hashlib
import json

from kvcache.kvstore.hashing import Namespace


def engine_namespace(config, block_size: int, layout: str, weights_id: str = "") -> Namespace:
    """Block keys depend on the model (its config's fingerprint and, with a cache, its weights:
    engine/cache/weights_id.py), the pool's block layout id (engine/cache/block_payload.py) and the block size."""
    fingerprint = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()[:32]
    model = f"{config.model_type}:{fingerprint}" + (f":{weights_id}" if weights_id else "")
    return Namespace(model, layout, block_size, name=config.model_type)
