"""The OpenAI SDK (unchanged) against `kvcache serve --model demo:v41-tiny`: chat completions,
completions and responses, streamed and not, their usage blocks and cached tokens on a shared
prefix, 16 concurrent greedy streams against one-by-one answers, and a client that disconnects."""

from __future__ import annotations

import asyncio
import http.client
import json
import time

import openai
import pytest

from tests.server.model_api.conftest import MODEL, NO_THINKING, long_text, metric, running_requests, start_server

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, text: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                          **{"max_tokens": 8, "temperature": 0, "extra_body": NO_THINKING, **kw})


def test_chat_answer_and_usage(client):
    r = chat(client, "Hello there")
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].finish_reason in ("length", "stop") and isinstance(r.choices[0].message.content, str)
    u = r.usage
    assert u.completion_tokens <= 8 and u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    assert u.model_extra["prompt_cache_hit_tokens"] == 0
    assert u.model_extra["prompt_cache_miss_tokens"] == u.prompt_tokens
    assert u.model_extra["cached_tokens_by_tier"] == {"hbm": 0, "dram": 0, "nvme": 0, "object": 0}


def test_chat_stream_has_usage_only_when_asked(client):
    chunks = list(chat(client, "Stream me", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 8
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat(client, "Stream me").choices[0].message.content     # greedy: the same answer
    assert all(c.usage is None for c in chat(client, "Stream me", stream=True))


def test_chat_thinking_streams_reasoning(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Think"}],
                                                 max_tokens=16, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert any((d.model_extra or {}).get("reasoning_content") for d in deltas)     # the model begins in <think>
    usage = chunks[-1].usage              # the engine's count: every token it generated
    assert usage.completion_tokens == 16 and usage.completion_tokens_details.reasoning_tokens <= 16


def test_completions_streamed_and_not(client):
    r = client.completions.create(model=MODEL, prompt="A prefix cache", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens <= 8
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.completions.create(model=MODEL, prompt="A prefix cache", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    by_ids = client.completions.create(model=MODEL, prompt=[0, 17, 42, 99], max_tokens=4, temperature=0)
    assert by_ids.usage.prompt_tokens == 4


def test_responses_streamed_and_not(client):
    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=8, reasoning={"effort": "none"},
                                temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.usage.input_tokens > 0 and r.usage.output_tokens <= 8
    assert r.usage.input_tokens_details.cached_tokens == 0
    events = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=8,
                                          reasoning={"effort": "none"}, temperature=0, stream=True))
    assert events[0].type == "response.created"
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.usage.output_tokens == r.usage.output_tokens
    assert last.response.output_text == r.output_text


def test_a_shared_prefix_is_cached_in_every_usage_format(server, client):
    hits_before = metric(server.url, "kvcache:prefix_cache_hits_total", 'tier="hbm"')
    prefix = long_text(140, seed=1)              # > 600 tokens, past the first snapshot point
    first = chat(client, prefix + " first question")
    assert first.usage.prompt_tokens > 600 and first.usage.prompt_tokens_details.cached_tokens == 0
    second = chat(client, prefix + " second question")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    extra = second.usage.model_extra
    assert extra["prompt_cache_hit_tokens"] == cached
    assert extra["prompt_cache_miss_tokens"] == second.usage.prompt_tokens - cached
    assert sum(extra["cached_tokens_by_tier"].values()) == cached
    assert metric(server.url, "kvcache:prefix_cache_hits_total", 'tier="hbm"') >= hits_before + cached
    resp = client.responses.create(model=MODEL, input=prefix + " third question", max_output_tokens=4,
                                   reasoning={"effort": "none"})
    assert resp.usage.input_tokens_details.cached_tokens > 0
    comp_prefix = long_text(140, seed=2)
    client.completions.create(model=MODEL, prompt=comp_prefix + " one", max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=comp_prefix + " two", max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_sixteen_concurrent_streams_equal_one_by_one_greedy_answers(server, client):
    prompts = [f"Question number {i}: what is a block?" for i in range(16)]
    alone = [chat(client, p).choices[0].message.content for p in prompts]

    async def one(ac, p):
        stream = await ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                  max_tokens=8, temperature=0, extra_body=NO_THINKING, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def together():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))
    assert asyncio.run(together()) == alone


def test_a_disconnect_mid_stream_frees_the_request(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Talk for a long time"}], "max_tokens": 30000,
            "ignore_eos": True, "stream": True, **NO_THINKING}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")          # the stream runs
    assert running_requests(server.url) == 1
    conn.sock.close()                                      # the client goes away mid-answer
    conn.close()
    deadline = time.time() + 30                           # far less than the 30000 tokens would take
    while running_requests(server.url) and time.time() < deadline:
        time.sleep(0.2)
    assert running_requests(server.url) == 0


def _stop_in(text: str) -> str:
    """Two plain characters from the middle of `text`, where they first occur."""
    return next(text[i:i + 2] for i in range(2, len(text) - 2)
                if text[i:i + 2].isascii() and text[i:i + 2].isalnum() and text.find(text[i:i + 2]) == i)


def test_a_stop_string_ends_the_answer_and_the_request(server, client):
    kw = {"max_tokens": 24, "extra_body": {**NO_THINKING, "ignore_eos": True}}
    full = chat(client, "Stop somewhere", **kw).choices[0].message.content
    stop = _stop_in(full)
    r = chat(client, "Stop somewhere", stop=[stop], **kw)
    assert r.choices[0].message.content == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    # the same greedy answer, allowed 30000 tokens: only the stop string can end it soon
    streamed = chat(client, "Stop somewhere", stop=stop, stream=True, **{**kw, "max_tokens": 30000})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[:full.index(stop)]
    deadline = time.time() + 30           # the abort lands after the engine's running step; far less than
    while running_requests(server.url) and time.time() < deadline:      # 30000 tokens would take
        time.sleep(0.2)
    assert running_requests(server.url) == 0              # the engine request ended at the stop string
    text = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = _stop_in(text)
    cut = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_tools_are_rendered_into_the_prompt(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object", "required": ["city"],
                                                              "properties": {"city": {"type": "string"}}}}}]
    plain = chat(client, "Weather in Paris?")
    with_tools = chat(client, "Weather in Paris?", tools=tools)       # the recipe's DSML tool section
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError):                        # the recipe: not in thinking mode
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                       tools=tools, tool_choice="required", max_tokens=4)


REPLAY_BLOCK, REPLAY_BLOCKS = 32, 1      # the replay server's block size and recomputed blocks per hit


@pytest.fixture(scope="module")
def replay_server(tmp_path_factory):
    """Replay mode, with small blocks so that short prompts span several."""
    cfg = tmp_path_factory.mktemp("replay") / "serve.toml"
    cfg.write_text(f"[engine]\nblock_size = {REPLAY_BLOCK}\n\n[cache]\nmode = \"replay\"\n"
                   f"replay_blocks = {REPLAY_BLOCKS}\n")
    s = start_server(tmp_path_factory, "--config", str(cfg))
    yield s
    s.kill()


def converse(client, thinking: bool, seed: int, turns: int = 4) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of each turn of a chat: each turn sends every earlier
    message, the answers as the server gave them, and a new question."""
    messages, usage = [{"role": "user", "content": long_text(40, seed)}], []
    for turn in range(turns):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                           extra_body={} if thinking else {**NO_THINKING, "temperature": 0})
        usage.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": f"Question {turn + 2}: " + long_text(6, seed + turn)}]
    return usage


def report(mode: str, thinking: bool, usage: list[tuple[int, int]]) -> str:
    return f"{mode}, thinking {'on' if thinking else 'off'}: " + ", ".join(
        f"turn {i + 1} {c}/{p} ({c / p:.0%})" for i, (p, c) in enumerate(usage))


@pytest.mark.parametrize("thinking", [False, True])
def test_each_turn_of_a_chat_resumes_after_the_previous_one_in_exact_mode(client, thinking):
    """The previous prompt is shared up to its cache point, just after its last <｜Assistant｜>:
    its last token (<think> or </think>) is the only one not resumed, and exact mode resumes
    exactly at the point (a snapshot there), so no slack beyond that one token."""
    usage = converse(client, thinking, seed=30 + thinking)
    print(report("exact", thinking, usage))
    assert usage[0][1] == 0
    for (prev, _), (prompt, cached) in zip(usage, usage[1:]):
        assert prompt > prev and cached >= prev - 1, report("exact", thinking, usage)


@pytest.mark.parametrize("thinking", [False, True])
def test_each_turn_of_a_chat_resumes_after_the_previous_one_in_replay_mode(replay_server, thinking):
    """Replay mode hits whole blocks only: every block wholly inside the shared part (the previous
    prompt but its last token), and none when those are no more than the blocks a hit recomputes
    (prefix_cache.py _replay_hit: the usage counts every loaded block, replayed ones included)."""
    oai = openai.OpenAI(base_url=replay_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    usage = converse(oai, thinking, seed=40 + thinking)
    print(report("replay", thinking, usage))
    assert usage[0][1] == 0
    for (prev, _), (prompt, cached) in zip(usage, usage[1:]):
        blocks = (prev - 1) // REPLAY_BLOCK
        assert blocks > REPLAY_BLOCKS and cached >= blocks * REPLAY_BLOCK, report("replay", thinking, usage)
