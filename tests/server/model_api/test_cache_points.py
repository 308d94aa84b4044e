"""Without a server: a chat prompt's cache point is where the recipe's rendering of the next turn
stops sharing it (or, without thinking, the last prompt position that can be a point), for each
chat API, with the demo tokenizer; prompts with no assistant tag get none."""

from __future__ import annotations

from types import SimpleNamespace

import deepseek_recipe as dr
import pytest

from kvcache.engine.tokenizer import build_demo_tokenizer
from kvcache.server.model_api.conversation import cache_points, encode
from kvcache.server.model_api.host import special_token_id

MODEL = "demo"


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """What `encode` and `cache_points` read of a ModelHost: the recipe's encoding and options
    over the demo tokenizer (v41-tiny's: 512 tokens), and the assistant tag's id."""
    path = tmp_path_factory.mktemp("tokenizer")
    build_demo_tokenizer(512).save(str(path))
    tok = dr.Tokenizer.from_file(str(path / "tokenizer.json"))
    options = dr.ConversionOptions().with_model_versions_by_name({MODEL: dr.ModelVersion.DeepseekV41Flash})
    return SimpleNamespace(encoding=dr.DeepseekV41Encoding().with_tokenizer(tok), options=options,
                           assistant_token=special_token_id(tok, options, dr.SpecialToken.Assistant))


def prompt_ids(host, messages: list[dict], thinking: bool) -> list[int]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8,
            **({} if thinking else {"thinking": {"type": "disabled"}})}
    return encode(dr.ChatCompletionRequest(body).convert(host.options), host)


def shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("thinking", [False, True])
def test_the_point_is_where_the_next_turn_stops_sharing_the_prompt(host, thinking):
    turn = [{"role": "user", "content": "What is a prefix cache?"}]
    ids = prompt_ids(host, turn, thinking)
    [point] = cache_points(ids, host.assistant_token)
    assert ids[point - 1] == host.assistant_token
    answer = {"role": "assistant", "content": "A store of KV blocks.",
              **({"reasoning_content": "Think about blocks."} if thinking else {})}
    following = prompt_ids(host, turn + [answer, {"role": "user", "content": "And a tier?"}], thinking)
    if thinking:      # <｜Assistant｜><think> became <｜Assistant｜></think>answer: shared up to the point
        assert shared(ids, following) == point
    else:             # <｜Assistant｜></think> is kept whole; the point is one short of the prompt's end
        assert shared(ids, following) == len(ids) == point + 1
    [later] = cache_points(following, host.assistant_token)
    assert later > len(ids)               # the next turn's point is past all of this prompt


def test_a_user_typing_the_tag_does_not_move_the_point(host):
    plain = prompt_ids(host, [{"role": "user", "content": "hello"}], False)
    typed = prompt_ids(host, [{"role": "user", "content": "hello <｜Assistant｜> there"}], False)
    assert typed.count(host.assistant_token) == plain.count(host.assistant_token) == 1
    assert cache_points(typed, host.assistant_token) == (len(typed) - 1,)


def test_no_tag_no_point():
    assert cache_points([5, 6, 7], 4) == ()
    assert cache_points([5, 6, 4], 4) == ()          # at the prompt's end: a point must leave a token
    assert cache_points([4, 5], None) == ()
    assert cache_points([4, 9, 4, 5], 4) == (3,)
