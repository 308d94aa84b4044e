"""The model server as a process: SIGTERM lets an in-flight stream finish before the engine and
then the store close; a restarted server on the same data directory still reports cached tokens
(from the store's tiers, the engine's pool being new); and `--cache URL` serves the model routes
alone, the engine keeping its blocks in a cache daemon elsewhere."""

from __future__ import annotations

import http.client
import json
import signal

import openai
import pytest

from tests.daemon_proc import DaemonProcess
from tests.server.model_api.conftest import MODEL, NO_THINKING, long_text

pytestmark = pytest.mark.timeout(900)


def chat(url: str, text: str, max_tokens: int = 4):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                          max_tokens=max_tokens, temperature=0, extra_body=NO_THINKING)


def model_server(data_dir, *args: str) -> DaemonProcess:
    server = DaemonProcess(data_dir, "--model", f"demo:{MODEL}", *args)
    try:
        server.wait_ready(timeout=240)
    except BaseException:
        server.kill()
        raise
    return server


def test_sigterm_drains_a_stream_and_a_restart_still_hits_the_store(tmp_path):
    prefix = long_text(140, seed=5)
    server = model_server(tmp_path / "data")
    try:
        assert chat(server.url, prefix + " before").usage.prompt_tokens_details.cached_tokens == 0
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on"}], "max_tokens": 200,
                "ignore_eos": True, "stream": True, **NO_THINKING}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")             # in flight
        server.proc.send_signal(signal.SIGTERM)
        rest = resp.read().decode()
        assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in rest
        assert server.proc.wait(timeout=120) == 0
        assert "stopped cleanly" in server.output()
    finally:
        server.kill()
    again = model_server(tmp_path / "data")
    try:
        usage = chat(again.url, prefix + " after").usage
        tiers = usage.model_extra["cached_tokens_by_tier"]
        assert usage.prompt_tokens_details.cached_tokens > 0 and tiers["hbm"] == 0   # from the store
    finally:
        again.kill()


def test_a_model_server_on_a_cache_daemon_elsewhere(tmp_path):
    with DaemonProcess(tmp_path / "cache") as cache:
        server = model_server(tmp_path / "model", "--cache", cache.url)
        try:
            prefix = long_text(140, seed=6)
            chat(server.url, prefix + " one")
            assert chat(server.url, prefix + " two").usage.prompt_tokens_details.cached_tokens > 0
            assert server.call("GET", "/v1/stats")[0] == 404          # no cache API here: no store of its own
            assert not (tmp_path / "model" / "index").exists()
            status, stats = cache.call("GET", "/v1/stats")
            assert status == 200 and json.loads(stats)["index_blocks"] > 0     # the blocks went there
        finally:
            server.kill()
