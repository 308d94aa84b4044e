"""The model server as a process: SIGTERM lets an in-flight stream finish before the engine and
then the store close; a restarted server on the same data directory still reports cached tokens
(from the store's tiers, the engine's pool being new); and `--cache URL` serves the model routes
alone, the engine keeping its blocks in a cache daemon elsewhere; the port opens before the model
has loaded (/ready and the model routes 503 until it is warm), and a model that fails to load
stops the process with a non-zero status."""

from __future__ import annotations

import fcntl
import http.client
import json
import signal
import time

import anthropic
import openai
import pytest

from tests.daemon_proc import DaemonProcess
from tests.server.model_api.conftest import (MODEL, NO_THINKING, long_text, model_server, running_requests,
                                             wait_model_ready)

pytestmark = pytest.mark.timeout(900)


def chat(url: str, text: str, max_tokens: int = 4):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                          max_tokens=max_tokens, temperature=0, extra_body=NO_THINKING)


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


def test_the_port_opens_before_the_model_has_loaded(tmp_path):
    """The demo build waits on its lock (held here), so the server is caught loading for sure:
    /health 200, /ready 503, the model routes 503 with Retry-After in their API's shape; then the
    load goes on and /ready turns 200."""
    models = tmp_path / "data" / "models"
    models.mkdir(parents=True)
    with open(models / f".{MODEL}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        server = DaemonProcess(tmp_path / "data", "--model", f"demo:{MODEL}")
        try:
            server.wait_ready()                                   # the daemon's /healthz: the port is open
            assert server.call("GET", "/health")[0] == 200
            status, body = server.call("GET", "/ready")
            assert (status, json.loads(body)) == (503, {"ready": False})
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            with pytest.raises(openai.InternalServerError) as e:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert e.value.status_code == 503 and "not ready" in e.value.message
            assert int(e.value.response.headers["retry-after"]) >= 1
            with pytest.raises(anthropic.InternalServerError) as e:
                anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0).messages.create(
                    model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            assert e.value.status_code == 503 and e.value.body["error"]["type"] == "overloaded_error"
            assert server.call("GET", "/v1/models")[0] == 503
            fcntl.flock(lock, fcntl.LOCK_UN)                      # the build goes on
            wait_model_ready(server)
            assert server.call("GET", "/health")[0] == 200
            assert chat(server.url, "hi").usage.prompt_tokens > 0
        finally:
            server.kill()


def test_a_model_that_fails_to_load_stops_the_server(tmp_path):
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-model"}')   # found at start, unloadable
    server = DaemonProcess(tmp_path / "data", "--model", str(bad))
    try:
        code = server.proc.wait(timeout=120)
        out = server.output()
        assert code != 0 and "the model did not load" in out and "stopped cleanly" not in out, out
    finally:
        server.kill()


def _sse(conn: http.client.HTTPConnection, path: str, body: dict) -> tuple[int, str]:
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, r.read().decode()


def test_a_request_past_the_timeout_is_aborted_with_the_apis_error(tmp_path):
    """--request-timeout 2: answers that would take minutes (30000 tokens, no end-of-sequence)
    end at the deadline, non-streamed as a 504 in the API's shape naming the timeout, streamed as
    an error event (or a 504, when the deadline comes before the first token), and free their
    blocks: no request is left running."""
    server = model_server(tmp_path / "data", "--request-timeout", "2")
    long = {"max_tokens": 30000, "ignore_eos": True, **NO_THINKING}
    timed_out = "request timeout (2 s)"
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go on"}],
                                           extra_body=long)
        assert e.value.status_code == 504 and timed_out in e.value.message
        assert e.value.body["type"] == "timeout_error" and e.value.body["code"] == "request_timeout"
        with pytest.raises(anthropic.InternalServerError) as e:
            anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120).messages.create(
                model=MODEL, max_tokens=4000, messages=[{"role": "user", "content": "Go on"}],
                thinking={"type": "disabled"}, extra_body={"ignore_eos": True})
        assert e.value.status_code == 504 and e.value.body["error"]["type"] == "timeout_error"
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Go on"}]}),
                           ("/v1/completions", {"prompt": "Go on"})):
            status, text = _sse(conn, path, {"model": MODEL, "stream": True, **long, **body})
            print(f"{path} streamed past the timeout: status {status}, {text.count('data: ')} frames")
            assert timed_out in text and "[DONE]" not in text, (path, status, text[-500:])
            if status == 200:                             # mid-stream: the last frame is the error
                last = json.loads(text.strip().rsplit("data: ", 1)[1])
                assert last["error"]["code"] == "request_timeout", last
            else:
                assert status == 504, (path, status)
        conn.close()
        deadline = time.time() + 30                   # the abort lands after the engine's step: poll
        while running_requests(server.url) and time.time() < deadline:
            time.sleep(0.2)
        assert running_requests(server.url) == 0
    finally:
        server.kill()
