"""Bad requests to the model routes get a 4xx in their API's own error shape, read through the
SDKs' exception types (raw HTTP where the SDKs cannot send the mistake): malformed JSON, unknown
models, invalid parameters, prompts past the context, oversized bodies, missing or wrong tokens.

One server with tokens and a config file that holds both the daemon's [server] and the engine's
[engine] sections (a pool of 16 blocks: a context of 2048 tokens, so an oversized prompt is cheap),
tenant limits of one request and 1500 tokens in flight, a sharing group of acme and acme-batch,
and an access log."""

from __future__ import annotations

import http.client
import json
import time

import anthropic
import openai
import pytest

from tests.server.model_api.conftest import MODEL, NO_THINKING, long_text, metric, start_server

pytestmark = pytest.mark.timeout(600)
TOKEN, METRICS_TOKEN = "model-test-token-0123456789", "model-metrics-token-0123456789"
OTHER_TOKEN = "model-other-token-0123456789"          # tenant "bravo"
BATCH_TOKEN = "model-batch-token-0123456789"          # tenant "acme-batch", in acme's sharing group
OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("cfg") / "serve.toml"
    cfg.write_text("[server]\nshutdown_timeout_s = 20\ncache_sharing = [[\"acme\", \"acme-batch\"]]\n\n"
                   "[engine]\nnum_blocks = 16\nmax_running = 8\n")
    s = start_server(tmp_path_factory, "--config", str(cfg), "--tenant-max-requests", "1", "--tenant-max-tokens",
                     "1500", "--access-log", str(cfg.parent / "access.log"),
                     env={"KVCACHE_TOKENS": f"{TOKEN}:acme,{OTHER_TOKEN}:bravo,{BATCH_TOKEN}:acme-batch,"
                                         f"{METRICS_TOKEN}::metrics"})
    s.access_log = cfg.parent / "access.log"
    yield s
    s.kill()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=TOKEN, max_retries=0, timeout=60)


def raw_post(server, path: str, body: bytes, token: str = TOKEN) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def assert_openai_shape(body: dict, kind: str = "invalid_request_error") -> None:
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    assert body["error"]["type"] == kind and body["error"]["message"]


def assert_anthropic_shape(body: dict, kind: str = "invalid_request_error") -> None:
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]


def test_the_engine_settings_came_from_the_shared_config_file(oai):
    with pytest.raises(openai.BadRequestError) as e:      # 2048 tokens of context: 16 blocks of 128
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2040)
    assert "2048" in e.value.message and e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("path", OPENAI_ROUTES + ANTHROPIC_ROUTES)
def test_malformed_json_is_a_400_in_the_api_shape(server, path):
    for body in (b'{"model": "v41-tiny", "messages": [', b"[1, 2]", b"\xff\xfe"):
        status, answer = raw_post(server, path, body)
        assert status == 400, answer
        (assert_anthropic_shape if path in ANTHROPIC_ROUTES else assert_openai_shape)(answer)


def test_a_number_past_64_bits_is_a_400_not_a_500(server):
    huge = 10 ** 30
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": huge}),
                       ("/v1/responses", {"input": "hi", "seed": huge}),
                       ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": huge}),
                       ("/v1/completions", {"prompt": "hi", "seed": huge})):
        status, answer = raw_post(server, path, json.dumps({"model": MODEL, **body}).encode())
        assert status == 400, (path, answer)
        (assert_anthropic_shape if path in ANTHROPIC_ROUTES else assert_openai_shape)(answer)


def test_a_body_past_the_limit_is_a_413(server):
    big = json.dumps({"model": MODEL, "prompt": "x" * (9 << 20)}).encode()
    status, answer = raw_post(server, "/v1/completions", big)
    assert status == 413
    assert_openai_shape(answer)


def test_an_unknown_model_is_a_404(oai, claude):
    msgs = [{"role": "user", "content": "hi"}]
    for call in (lambda: oai.chat.completions.create(model="gpt-9", messages=msgs, max_tokens=2),
                 lambda: oai.completions.create(model="gpt-9", prompt="hi", max_tokens=2),
                 lambda: oai.responses.create(model="gpt-9", input="hi", max_output_tokens=2)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.code == "model_not_found" and "gpt-9" in e.value.message
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-9", max_tokens=2, messages=msgs)
    assert e.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 2), ("n", 5), ("logprobs", True),
                                          ("presence_penalty", 5), ("max_completion_tokens", 0), ("top_k", -5),
                                          ("logit_bias", {"999999": 1}), ("repetition_penalty", 0),
                                          ("seed", -1), ("stop", [""])])
def test_invalid_chat_parameters_are_400s(oai, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_body={field: value, **NO_THINKING})
    assert e.value.status_code == 400 and e.value.message
    if field in ("logprobs",):
        assert "not supported" in e.value.message


@pytest.mark.parametrize("extra", [{"temperature": 3}, {"top_p": 2}, {"top_logprobs": 2},
                                   {"previous_response_id": "resp_1"}])
def test_invalid_responses_parameters_are_400s(oai, extra):
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body=extra)


@pytest.mark.parametrize("extra", [{"temperature": -1}, {"top_p": 2}, {"top_k": -3}])
def test_invalid_messages_parameters_are_400s_in_anthropic_shape(claude, extra):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                               extra_body=extra)
    assert_anthropic_shape(e.value.body)


def test_prompts_past_the_context_are_refused_before_any_compute(oai, claude):
    text = long_text(500, seed=9)          # over 2048 tokens
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt=text, max_tokens=2)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": text}])
    assert_anthropic_shape(e.value.body)


def test_model_routes_need_a_token(server, oai, claude):
    for key in ("", "wrong-token"):
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=server.url + "/v1", api_key=key or "-", max_retries=0).models.list()
        assert e.value.body["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=server.url, api_key=key or "-", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert_anthropic_shape(e.value.body, "authentication_error")
    with pytest.raises(openai.PermissionDeniedError):      # a metrics token reads /metrics only
        openai.OpenAI(base_url=server.url + "/v1", api_key=METRICS_TOKEN, max_retries=0).models.list()
    assert [m.id for m in oai.models.list()] == [MODEL]
    m = claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                               thinking={"type": "disabled"})          # x-api-key is the anthropic SDK's header
    assert m.usage.output_tokens <= 2
    status, _ = server.call("GET", "/ready")
    assert status == 200                                     # readiness needs no token


def test_tenant_limits_answer_429_with_retry_after_and_400_for_what_never_fits(server, oai):
    with pytest.raises(openai.BadRequestError, match="1500"):          # prompt + max_tokens past the cap
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1600)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on"}], "max_tokens": 1000,
            "ignore_eos": True, "stream": True, **NO_THINKING}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    try:
        assert conn.getresponse().readline().startswith(b"data: ")    # the tenant's one request in flight
        with pytest.raises(openai.RateLimitError) as e:
            oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert int(e.value.response.headers["retry-after"]) >= 1
    finally:
        conn.close()
    scrape = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    for reason in ("tenant_requests", "too_large"):           # each refusal counted once
        assert metric(server.url, "kvcache:requests_rejected_total", f'reason="{reason}"', scrape) == 1


def test_the_access_log_has_a_line_per_model_request(server, oai):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="hi", max_tokens=2)
    deadline = time.time() + 60
    while True:                        # the stream the test above left may still hold the tenant's place
        try:
            oai.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.time() < deadline, "the abandoned stream never gave its place back"
            time.sleep(0.2)
    lines = [json.loads(line) for line in server.access_log.read_text().splitlines()]
    assert any(r["status"] == 404 and r["api"] == "completions" and r["tenant"] == "acme" for r in lines)
    ok = [r for r in lines if r["status"] == 200 and r["api"] == "completions"][-1]
    assert ok["prompt_tokens"] > 0 and ok["generated_tokens"] <= 2 and ok["request_id"].startswith("cmpl-")
    assert any(r["status"] == 401 and r["tenant"] is None for r in lines)     # the token check's refusals too


def test_a_tenant_gets_cached_tokens_only_from_its_own_and_its_groups_prompts(server, oai):
    prefix = long_text(130, seed=12)         # under the 2048-token context, past a 512-token snapshot point
    other, batch = (openai.OpenAI(base_url=server.url + "/v1", api_key=token, max_retries=0, timeout=60)
                    for token in (OTHER_TOKEN, BATCH_TOKEN))

    def cached(client, text):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                           max_tokens=2, extra_body=NO_THINKING)
        return r.usage.prompt_tokens_details.cached_tokens
    assert cached(oai, prefix + " one") == 0
    assert cached(other, prefix + " two") == 0                 # tenant bravo: acme's prefix is not its own
    assert cached(batch, prefix + " three") > 0                # acme-batch shares acme's group
    assert cached(oai, prefix + " four") > 0                   # acme's own prefix hits
    assert cached(other, long_text(130, seed=13) + " five") == 0
    assert cached(batch, long_text(130, seed=13) + " six") == 0   # bravo's prefix is not the group's
