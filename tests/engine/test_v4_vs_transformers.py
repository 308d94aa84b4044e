"""DeepseekV4ForCausalLM against transformers' implementation on the same random weights (fp32):
whole-prompt prefill, chunked prefill and token-by-token decode agree to 1e-4 relative.

Index scores tie when every head's relu is 0; our indexer breaks ties by entry age (stable sort),
transformers' topk in whatever order the kernel leaves them (even differently in prefill and
decode). The tiny config uses 8 index heads so that no tie reaches a top-k boundary here."""

from contextlib import contextmanager
from unittest.mock import patch

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4Config                                      # noqa: E402
from transformers import DeepseekV4ForCausalLM as HFDeepseekV4                 # noqa: E402

from kvcache.engine.checkpoint.hf_names import from_transformers, to_transformers   # noqa: E402
from kvcache.engine.checkpoint.loader import load_model                        # noqa: E402
from kvcache.engine.layers.compressor import Indexer                           # noqa: E402
from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM            # noqa: E402
from tests.engine.tiny import V4_TINY, randomize, v4_config                     # noqa: E402

TOL = 1e-4


def hf_config() -> DeepseekV4Config:
    c = V4_TINY
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 16: "heavily_compressed_attention"}
    n = c["num_hidden_layers"]
    return DeepseekV4Config(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=n,
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=1, head_dim=c["head_dim"],
        q_lora_rank=c["q_lora_rank"], o_groups=c["o_groups"], o_lora_rank=c["o_lora_rank"],
        sliding_window=c["sliding_window"], layer_types=[kinds[r] for r in c["compress_ratios"][:n]],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        mlp_layer_types=["hash_moe"] * c["num_hash_layers"] + ["moe"] * (n - c["num_hash_layers"]),
        n_routed_experts=c["n_routed_experts"], n_shared_experts=1, num_experts_per_tok=c["num_experts_per_tok"],
        moe_intermediate_size=c["moe_intermediate_size"], index_n_heads=c["index_n_heads"],
        index_head_dim=c["index_head_dim"], index_topk=c["index_topk"], hc_mult=c["hc_mult"],
        hc_sinkhorn_iters=c["hc_sinkhorn_iters"], hc_eps=c["hc_eps"], rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c["rope_theta"], compress_rope_theta=c["compress_rope_theta"],
        rope_parameters={"rope_type": "yarn", **{k: v for k, v in c["rope_scaling"].items() if k != "type"}},
        partial_rotary_factor=c["qk_rope_head_dim"] / c["head_dim"], max_position_embeddings=4096,
        routed_scaling_factor=c["routed_scaling_factor"], swiglu_limit=c["swiglu_limit"],
        tie_word_embeddings=False, attn_implementation="eager")


@pytest.fixture(scope="module")
def pair():
    ours = randomize(DeepseekV4ForCausalLM(v4_config())).eval()
    hf = HFDeepseekV4(hf_config()).eval()
    missing, unexpected = hf.load_state_dict(to_transformers(ours.state_dict()), strict=False)
    assert not unexpected and all("rotary" in m or "inv_freq" in m for m in missing), (missing, unexpected)
    return ours, hf


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, V4_TINY["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_prefill_logits_match(pair):
    ours, hf = pair
    ids = _prompt(70)                     # several HCA windows (16), CSA entries past the top-k (4)
    ref = hf(input_ids=ids, use_cache=True).logits
    got = ours(ids)
    assert _rel(got, ref) <= TOL


@torch.no_grad()
def test_decode_step_by_step_matches(pair):
    ours, hf = pair
    ids = _prompt(40, seed=2)
    out = hf(input_ids=ids[:, :21], use_cache=True)
    cache, ref = out.cache, [out.logits]
    for t in range(21, 40):
        out = hf(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
        cache = out.cache
        ref.append(out.logits)
    ref = torch.cat(ref, 1)
    state = ours.new_state()
    got = [ours(ids[:, :21], state)] + [ours(ids[:, t:t + 1], state) for t in range(21, 40)]
    assert _rel(torch.cat(got, 1), ref) <= TOL


@torch.no_grad()
def test_chunked_prefill_equals_one_pass(pair):
    ours, _ = pair
    ids = _prompt(53, seed=3)
    whole = ours(ids)
    state, parts = ours.new_state(), []
    for a, b in ((0, 5), (5, 21), (21, 22), (22, 53)):      # unaligned to 4, 8 and 16 on purpose
        parts.append(ours(ids[:, a:b], state))
    assert _rel(torch.cat(parts, 1), whole) <= TOL


def test_name_maps_round_trip(pair):
    ours, hf = pair
    official = ours.state_dict()
    back = dict(from_transformers(hf.state_dict()))
    assert set(back) == {k for k in official if not k.startswith("mtp.")}
    assert all(torch.equal(back[k], official[k]) for k in back)


@torch.no_grad()
def test_mtp_block_runs_a_forward_pass(pair):
    """The MTP block (transformers has none) drafts from the target's streams and the next tokens."""
    ours, _ = pair
    ids = _prompt(24, seed=4)
    state = ours.new_state()
    streams = ours.streams(ids[:, :-1], state)
    logits = ours.mtp_logits(streams, ids[:, 1:], state, start=0)
    assert logits.shape == (1, 23, V4_TINY["vocab_size"]) and torch.isfinite(logits).all()
    assert state.drafter[0].window.shape[1] == V4_TINY["sliding_window"] - 1
    state2 = ours.new_state()
    again = ours.mtp_logits(ours.streams(ids[:, :-1], state2), ids[:, 1:], state2, start=0)
    assert torch.equal(logits, again)


@contextmanager
def _ties_at_topk_boundary():
    """Per indexer query of the forward passes inside: 1 if its k-th and (k+1)-th best visible
    index scores are equal (Indexer.select_from's scores, recomputed), where tie order decides."""
    ties: list[int] = []
    select_from = Indexer.select_from

    def spy(self, q, w, positions, keys):
        index = (torch.relu(torch.einsum("bthd,bnd->bthn", q, keys.float())) * w[..., None]).sum(2)
        for t, n in enumerate(((positions + 1) // self.ratio).tolist()):
            if n > self.topk:
                best = index[:, t, :n].sort(dim=-1, descending=True).values
                ties.append(int((best[:, self.topk - 1] == best[:, self.topk]).any()))
        return select_from(self, q, w, positions, keys)
    with patch.object(Indexer, "select_from", spy):
        yield ties


@torch.no_grad()
def test_checkpoint_saved_by_transformers_loads_and_matches(pair, tmp_path):
    """What the installed transformers' `save_pretrained` writes (5.24: official names behind
    `model.`, `head.weight`, the attention's kv_norm as `attn.norm`) loads with its own config.json
    (no MTP block) and gives transformers' logits. The weights and prompt are chosen with no index
    score tie at a top-k boundary (asserted): there transformers' pick is arbitrary, so a tie
    would fail the comparison without a bug on either side."""
    _, hf = pair
    hf.save_pretrained(str(tmp_path))
    loaded, config = load_model(str(tmp_path), progress=False)
    assert config.num_nextn_predict_layers == 0
    ids = _prompt(70, seed=5)
    with _ties_at_topk_boundary() as ties:
        got = loaded(ids)
    assert ties and sum(ties) == 0, f"{sum(ties)} of {len(ties)} queries tie at the top-k boundary"
    assert _rel(got, hf(input_ids=ids).logits) <= TOL
