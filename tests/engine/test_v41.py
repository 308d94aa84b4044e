"""DeepSeek-V4.1: the fast path against the slow reference written from the definitions; one
chunk == many chunks == token by token; Engram hashing; prefill truncation; DSpark; checkpoints."""

import numpy as np
import pytest
import torch

from kvcache.engine.checkpoint.loader import load_model
from kvcache.engine.checkpoint.writer import save_checkpoint, snap_to_formats
from kvcache.engine.layers.engram import compressed_token_map, hash_geometry
from kvcache.engine.models.deepseek_v41 import DeepseekV41ForCausalLM
from kvcache.engine.models.dspark import greedy_draft, write_context
from kvcache.engine.tokenizer import build_demo_tokenizer
from tests.engine.tiny import randomize, v41_config
from tests.engine.v41_reference import reference_logits

IMAGE = 11


@pytest.fixture(scope="module")
def token_map():
    return compressed_token_map(build_demo_tokenizer(512))


@pytest.fixture(scope="module")
def model(token_map):
    m = randomize(DeepseekV41ForCausalLM(v41_config(int(token_map.max()) + 1)), seed=3)
    m.set_token_map(token_map)
    return m.eval()


def _ids(n, seed=0, image_at=()):
    ids = torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(seed))
    for i in image_at:
        ids[0, i] = IMAGE
    return ids


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def test_fast_path_matches_the_reference(model):
    ids = _ids(34, image_at=(9,))                       # 17 ratio-2 pairs, 34 ratio-1 entries, an image token
    assert _rel(model(ids)[0], reference_logits(model, ids[0].tolist())) < 1e-5


@torch.no_grad()
def test_one_chunk_equals_many_chunks_equals_token_by_token(model):
    ids = _ids(45, seed=1, image_at=(20,))
    whole = model(ids)
    state = model.new_state()
    chunks = torch.cat([model(ids[:, a:b], state) for a, b in ((0, 7), (7, 8), (8, 30), (30, 45))], 1)
    state = model.new_state()
    steps = torch.cat([model(ids[:, t:t + 1], state) for t in range(45)], 1)
    assert _rel(chunks, whole) < 1e-4 and _rel(steps, whole) < 1e-4


def test_every_path_matters(model, token_map):
    """The comparison above can fail: change one definition and the logits move."""
    ids = _ids(30, seed=2)
    with torch.no_grad():
        base = model(ids)
        other = randomize(DeepseekV41ForCausalLM(v41_config(int(token_map.max()) + 1, index_topk=2)), seed=3)
        other.set_token_map(token_map)
        assert _rel(other.eval()(ids), base) > 1e-3                      # top-k size
        shuffled = token_map.copy()
        shuffled[[5, 6]] = shuffled[[6, 5]]
        model.set_token_map(shuffled)
        try:
            assert _rel(model(ids), base) > 1e-4                         # Engram reads the n-grams
        finally:
            model.set_token_map(token_map)


def test_engram_geometry_and_image_tokens(model, token_map):
    c = model.config
    mults, primes, offsets = hash_geometry(c)
    assert (mults % 2 == 1).all() and len(set(primes.ravel())) == primes.size
    assert (primes > c.engram_vocab_size - 1).all()
    assert all(primes[i].sum() <= c.engram_num_embeddings[i] for i in range(len(primes)))
    assert (offsets[:, 1:] == np.cumsum(primes, 1)[:, :-1]).all()
    # an image token breaks the n-grams of the next max_ngram - 1 positions and gets no Engram
    state = model.new_state()
    values, alive = model._engram_inputs(_ids(12, image_at=(5,)), state)
    pad = int(token_map[c.engram_pad_token_id])
    assert not alive[0, 5] and alive[0, 6]
    for p in (6, 7, 8):
        assert (values[0, p, p - 5:] == pad).all() and (values[0, p, : p - 5] != pad).all()
    assert (values[0, 9] != pad).all()


@torch.no_grad()
def test_prefill_truncation_is_a_bounded_approximation(model, token_map):
    ids = _ids(40, seed=4)
    exact = model(ids)
    trunc = DeepseekV41ForCausalLM(model.config, prefill_keep_tokens=12)
    trunc.load_state_dict(model.state_dict())
    trunc.set_token_map(token_map)
    out = trunc.eval()(ids)
    assert out.shape[1] == 12                                  # logits for the kept tail only
    assert 0 < _rel(out, exact[:, -12:]) < 1.0                 # approximate, not equal
    full_keep = DeepseekV41ForCausalLM(model.config, prefill_keep_tokens=40)
    full_keep.load_state_dict(model.state_dict())
    full_keep.set_token_map(token_map)
    assert _rel(full_keep.eval()(ids), exact) < 1e-6           # keeping everything is exact
    with pytest.raises(ValueError, match="sliding window"):
        DeepseekV41ForCausalLM(model.config, prefill_keep_tokens=4)


@torch.no_grad()
def test_dspark_drafter_forward(model):
    c = model.config
    ids = _ids(20, seed=5)
    state = model.new_state()
    _, positions, taps = model.streams(ids, state, collect=tuple(c.extra["dspark_target_layer_ids"]))
    write_context(model, taps, positions, state.drafter)
    assert all(st.window.shape[1] == c.sliding_window - 1 for st in state.drafter)
    tokens, conf = greedy_draft(model, ids[:, -1], 20, state.drafter)
    assert tokens.shape == (1, c.extra["dspark_block_size"]) and ((conf > 0) & (conf < 1)).all()
    again, _ = greedy_draft(model, ids[:, -1], 20, state.drafter)
    assert torch.equal(tokens, again)                           # drafting does not touch the context cache


@torch.no_grad()
def test_quantised_checkpoint_round_trip(model, token_map, tmp_path):
    import dataclasses
    cfg = dataclasses.replace(model.config, quantization={"quant_method": "fp8", "weight_block_size": [32, 32],
                                                          "scale_fmt": "ue8m0", "expert_dtype": "fp4"})
    m = DeepseekV41ForCausalLM(cfg)
    m.load_state_dict(model.state_dict())
    snap_to_formats(m, cfg)
    save_checkpoint(m, cfg, str(tmp_path))
    build_demo_tokenizer(512).save(str(tmp_path))
    m.set_token_map(token_map)
    loaded, _ = load_model(str(tmp_path), progress=False)
    ids = _ids(25, seed=6)
    assert torch.equal(loaded(ids), m.eval()(ids))
