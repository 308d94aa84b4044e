"""The Anthropic SDK (unchanged) against `kvcache serve --model demo:v41-tiny`: messages streamed
and not, count_tokens, and cache_read_input_tokens on a shared prefix (input_tokens = prompt -
cached)."""

from __future__ import annotations

import anthropic
import pytest

from tests.server.model_api.conftest import MODEL, long_text

pytestmark = pytest.mark.timeout(600)
OFF = {"type": "disabled"}
GREEDY = {"temperature": 0}      # (the 2.x SDK has no temperature argument: sent as an extra field)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def ask(client, text: str, **kw):
    return client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": text}],
                                  **{"thinking": OFF, "extra_body": GREEDY, **kw})


def test_message_answer_and_usage(client):
    m = ask(client, "Hello there")
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason in ("max_tokens", "end_turn") and m.content[0].type == "text"
    assert m.usage.output_tokens <= 8 and m.usage.input_tokens > 0
    assert m.usage.cache_read_input_tokens == 0
    assert m.usage.model_extra["cached_tokens_by_tier"]["hbm"] == 0


def test_message_stream_matches_the_answer(client):
    with client.messages.stream(model=MODEL, max_tokens=8, thinking=OFF, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Stream this"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and "message_stop" in kinds
    assert final.content[0].text == ask(client, "Stream this").content[0].text
    assert final.usage.output_tokens <= 8


def test_thinking_comes_as_a_thinking_block(client):
    m = client.messages.create(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Think first"}],
                               extra_body={"ignore_eos": True})
    assert m.content[0].type == "thinking"
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 16    # every token the engine generated


def test_count_tokens_is_the_prompt_the_message_runs_with(client):
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages, thinking=OFF).input_tokens
    m = client.messages.create(model=MODEL, max_tokens=2, messages=messages, thinking=OFF)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_a_shared_prefix_is_read_from_the_cache(client):
    prefix = long_text(140, seed=3)
    first = ask(client, prefix + " first question")
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens > 600
    second = ask(client, prefix + " second question")
    cached = second.usage.cache_read_input_tokens
    assert cached > 0
    prompt = client.messages.count_tokens(model=MODEL, thinking=OFF,
                                          messages=[{"role": "user", "content": prefix + " second question"}])
    assert second.usage.input_tokens == prompt.input_tokens - cached
    assert sum(second.usage.model_extra["cached_tokens_by_tier"].values()) == cached
