"""Reconfiguring a running daemon: POST /v1/admin/reconfigure (in-process) and SIGHUP (real process)."""

import json
import signal
import time

from tests.server.test_serve_process import Daemon
from tests.server.test_server import ADMIN, ALICE, BOB, auth, client, register  # noqa: F401 (fixture)

CAROL = "d" * 32


def config(tokens, ttl_hours=72, dram_mib=8):
    return {"server": {"tokens": tokens, "max_keys": 100, "max_block_bytes": 1 << 20, "max_batch_blocks": 64},
            "retention": {"ttl_hours": ttl_hours},
            "dram": {"capacity_bytes": dram_mib << 20, "page_bytes": 1 << 20, "prefault": False},
            "nvme": {"segment_bytes": 1 << 20}}


async def test_tokens_and_retention_change_live_the_rest_needs_a_restart(client):  # noqa: F811
    store = client.server.app[__import__("kvcache.server.request_state", fromlist=["STORE"]).STORE]
    tokens = [{"token": ALICE, "tenant": "alice"}, {"token": CAROL, "tenant": "carol", "quota_bytes": 5000},
              {"token": ADMIN, "tenant": "ops", "admin": True}]          # BOB revoked, CAROL added
    emptied = []
    store.dram.unpublish_all = lambda: emptied.append(True)   # the read directory's deadlines are stale
    r = await client.post("/v1/admin/reconfigure", json=config(tokens, ttl_hours=1, dram_mib=16), headers=auth(ADMIN))
    assert r.status == 200, await r.text()
    body = await r.json()
    assert set(body["applied"]) == {"server.tokens", "retention"} and body["restart_required"] == ["dram"]
    assert store.config.retention.default.ttl_s == 3600 and store.config.dram.capacity_bytes == 8 << 20
    assert emptied == [True]
    assert (await client.post("/v1/lookup", json={"keys": []}, headers=auth(BOB))).status == 401
    assert await register(client, CAROL)
    r = await client.put("/v1/blocks/" + "ab" * 16, data=b"x" * 6000,
                         headers={**auth(CAROL), "X-KVCache-Namespace": (await register(client, CAROL))})
    assert r.status == 507                                                # the new quota holds


async def test_reconfigure_needs_admin_and_a_valid_config(client):  # noqa: F811
    good = [{"token": ALICE, "tenant": "alice"}, {"token": ADMIN, "tenant": "ops", "admin": True}]
    assert (await client.post("/v1/admin/reconfigure", json=config(good), headers=auth(ALICE))).status == 403
    bad = config(good)
    bad["retention"] = {"ttl_hours": -1}
    r = await client.post("/v1/admin/reconfigure", json=bad, headers=auth(ADMIN))
    assert r.status == 400 and "ttl" in (await r.json())["message"]
    short = config([{"token": "short", "tenant": "x"}])
    assert (await client.post("/v1/admin/reconfigure", json=short, headers=auth(ADMIN))).status == 400
    assert (await client.post("/v1/lookup", json={"keys": []}, headers=auth(BOB))).status == 200   # unchanged
    r = await client.post("/v1/admin/reconfigure", headers=auth(ADMIN))   # no body and no --config file
    assert r.status == 400 and "--config" in (await r.json())["message"]


async def test_the_engine_sections_of_a_shared_config_are_not_the_daemons(client):  # noqa: F811
    good = [{"token": ALICE, "tenant": "alice"}, {"token": ADMIN, "tenant": "ops", "admin": True}]
    shared = {**config(good), "engine": {"num_blocks": 64}, "cache": {"mode": "exact"}}   # kvcache serve --model's
    r = await client.post("/v1/admin/reconfigure", json=shared, headers=auth(ADMIN))
    assert r.status == 200, await r.text()


def _toml(tokens) -> str:
    lines = ["[retention]", "ttl_hours = 72", ""]
    for t, tenant in tokens:
        lines += ["[[server.tokens]]", f'token = "{t}"', f'tenant = "{tenant}"', "admin = true", ""]
    return "\n".join(lines)


def test_sighup_rereads_the_config_file(tmp_path):
    cfg = tmp_path / "kv.toml"
    cfg.write_text(_toml([(ALICE, "alice")]))
    d = Daemon(tmp_path / "data", "--config", str(cfg))
    try:
        d.wait_ready()
        assert d.call("POST", "/v1/lookup", {"keys": []}, auth(BOB))[0] == 401
        cfg.write_text(_toml([(ALICE, "alice"), (BOB, "bob")]))
        d.proc.send_signal(signal.SIGHUP)
        for _ in range(50):
            if d.call("POST", "/v1/lookup", {"keys": []}, auth(BOB))[0] == 200:
                break
            time.sleep(0.1)
        assert d.call("POST", "/v1/lookup", {"keys": []}, auth(BOB))[0] == 200
        cfg.write_text(_toml([(BOB, "bob")]))                 # and the endpoint re-reads it too
        status, body = d.call("POST", "/v1/admin/reconfigure", None, auth(BOB))
        assert status == 200 and json.loads(body)["applied"] == ["server.tokens"]
        assert d.call("POST", "/v1/lookup", {"keys": []}, auth(ALICE))[0] == 401
        cfg.write_text("[retention\n")                         # broken file: logged, nothing changes
        d.proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        assert d.call("POST", "/v1/lookup", {"keys": []}, auth(BOB))[0] == 200
    finally:
        out = d.stop()
    assert "SIGHUP reload" in out and "stopped cleanly" in out
