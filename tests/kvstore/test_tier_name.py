"""TierName: the one tier label store and engine share, spelled as the plain strings it replaced."""

import json

import pytest

from kvcache.kvstore.types import STORE_TIERS, Tier, TierName


def test_store_tier_names_are_the_store_labels():
    assert [t.label for t in (Tier.DRAM, Tier.NVME, Tier.OBJECT)] == list(STORE_TIERS)
    assert [str(t) for t in TierName] == ["hbm", "dram", "nvme", "object"]      # fastest first


def test_a_block_is_named_by_its_fastest_tier():
    assert TierName.of(Tier.DRAM | Tier.NVME) is TierName.DRAM
    assert TierName.of(Tier.NVME | Tier.OBJECT) is TierName.NVME
    assert TierName.of(Tier.OBJECT) is TierName.OBJECT
    with pytest.raises(ValueError):
        TierName.of(Tier.NONE)


def test_outputs_read_as_the_plain_strings():
    """JSON fields, f-strings (usage lines, logs) and dict lookups by string are unchanged."""
    usage = {TierName.HBM: 32, TierName.DRAM: 96}
    assert json.dumps(usage) == '{"hbm": 32, "dram": 96}'
    assert ", ".join(f"{t} {n}" for t, n in usage.items()) == "hbm 32, dram 96"
    assert usage == {"hbm": 32, "dram": 96} and usage["dram"] == 96
