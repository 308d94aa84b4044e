"""Importing a client, open_store or the engine's cache loads neither LMDB, nor the tiers, nor
BlockStore (client/__init__.py): checked in a fresh interpreter, where nothing is imported yet."""

import subprocess
import sys

import pytest

HEAVY = ("lmdb", "kvcache.tiering", "kvcache.kvstore.store", "kvcache.kvstore.index", "kvcache.gc")


@pytest.mark.parametrize("module", ["kvcache.client", "kvcache.client.sync_client", "kvcache.client.async_client",
                                    "kvcache.client.open_store", "kvcache.kvstore.protocol",
                                    "kvcache.engine.cache.connector"])
def test_importing_leaves_the_store_core_alone(module):
    code = (f"import sys, {module}\n"
            f"loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in {HEAVY!r}))\n"
            "print(','.join(loaded))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"


def test_open_store_loads_the_store_core_only_for_a_directory(tmp_path):
    code = ("import sys\nfrom kvcache.client.open_store import open_store\n"
            "c = open_store('http://127.0.0.1:1'); c.close()\n"
            "assert 'kvcache.kvstore.store' not in sys.modules and 'lmdb' not in sys.modules\n"
            f"with open_store({str(tmp_path / 'd')!r}, dram=None):\n    pass\n"
            "assert 'kvcache.kvstore.store' in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
