"""Checkpoints: official sharded layout with FP8/FP4 tensors, transformers layout (module names and
5.24's save names), and the errors that name the offending tensor."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvcache.engine.checkpoint.hf_names import to_transformers
from kvcache.engine.checkpoint.loader import CheckpointError, load_model
from kvcache.engine.checkpoint.writer import save_checkpoint, snap_to_formats
from kvcache.engine.model_config import ConfigError
from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from tests.engine.tiny import randomize, v4_config

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
         "expert_dtype": "fp4"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = v4_config(quantization_config=QUANT)
    model = randomize(DeepseekV4ForCausalLM(cfg)).eval()
    snap_to_formats(model, cfg)
    d = tmp_path_factory.mktemp("ckpt")
    files = save_checkpoint(model, cfg, str(d), shard_bytes=300_000)
    return model, cfg, d, files


def _ids(n=37):
    return torch.randint(2, 384, (1, n), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def test_official_sharded_checkpoint_round_trips_exactly(saved):
    model, cfg, d, files = saved
    assert len(files) > 1
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {}
    for f in files:
        stored.update(load_file(str(d / f)))
    assert stored["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert stored["layers.2.ffn.experts.3.w1.weight"].dtype == torch.int8          # packed FP4
    assert stored["layers.2.ffn.experts.3.w1.scale"].shape == (32, 64 // 32)
    assert stored["layers.0.hc_attn_fn"].dtype == torch.float32 and stored["embed.weight"].dtype == torch.bfloat16
    assert set(index) == set(stored)
    loaded, lcfg = load_model(str(d), progress=False)
    assert lcfg == cfg
    assert torch.equal(loaded(_ids()), model(_ids()))


@torch.no_grad()
def test_transformers_layout_loads(saved, tmp_path):
    model, cfg, d, _ = saved
    hf = tmp_path / "hf"
    hf.mkdir()
    tensors = {k: v.contiguous() for k, v in to_transformers(model.state_dict()).items()}
    save_file(tensors, str(hf / "model.safetensors"))
    plain = {k: v for k, v in cfg.to_dict().items() if k not in ("quantization_config", "num_nextn_predict_layers")}
    (hf / "config.json").write_text(json.dumps(plain))
    loaded, lcfg = load_model(str(hf), progress=False)
    assert lcfg.num_nextn_predict_layers == 0 and not lcfg.quantization
    ref = DeepseekV4ForCausalLM(lcfg).eval()
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    assert torch.equal(loaded(_ids()), ref(_ids()))


def _as_transformers_5_saves(official: dict) -> dict:
    """What transformers 5.24's `save_pretrained` writes for these weights (hf_names.py's module doc)."""
    glob = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "head.weight": "head.weight", **{f"hc_head_{p}": f"model.hc_head.hc_{p}" for p in ("fn", "base", "scale")}}
    return {glob.get(k, "model." + k.replace(".attn.kv_norm.", ".attn.norm.")): v.contiguous()
            for k, v in official.items() if not k.startswith("mtp.")}


@torch.no_grad()
def test_transformers_5_saved_layout_loads_and_unknown_names_are_refused(saved, tmp_path):
    model, cfg, _, _ = saved
    hf = tmp_path / "hf5"
    hf.mkdir()
    tensors = _as_transformers_5_saves(model.state_dict())
    assert "model.layers.0.attn.norm.weight" in tensors and "head.weight" in tensors
    save_file(tensors, str(hf / "model.safetensors"))
    plain = {k: v for k, v in cfg.to_dict().items() if k != "quantization_config"}
    (hf / "config.json").write_text(json.dumps(plain))       # keeps num_nextn_predict_layers, as transformers
    loaded, lcfg = load_model(str(hf), progress=False)
    assert lcfg.num_nextn_predict_layers == 0                 # transformers saves no MTP block
    want = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    got = loaded.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    save_file({**tensors, "model.layers.0.attn.mystery.weight": torch.zeros(2)}, str(hf / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.attn.mystery.weight' has no place"):
        load_model(str(hf), progress=False)


def _copy(saved, tmp_path, mutate):
    _, _, d, files = saved
    out = tmp_path / "bad"
    out.mkdir(parents=True)
    for f in os.listdir(d):
        (out / f).write_bytes((d / f).read_bytes())
    mutate(out, files)
    return out


def _rewrite(out, files, fn):
    for f in files:
        t = load_file(str(out / f))
        save_file(fn(t), str(out / f))


def test_missing_tensor_is_named(saved, tmp_path):
    def drop(out, files):
        _rewrite(out, files, lambda t: {k: v for k, v in t.items() if k != "layers.3.attn.wkv.weight"})
        idx = json.loads((out / "model.safetensors.index.json").read_text())
        del idx["weight_map"]["layers.3.attn.wkv.weight"]
        (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="layers.3.attn.wkv.weight"):
        load_model(str(_copy(saved, tmp_path, drop)), progress=False)


def test_wrong_shape_and_dtype_are_named(saved, tmp_path):
    def reshape(out, files):
        _rewrite(out, files, lambda t: {k: (v[:-1] if k == "layers.1.attn.attn_sink" else v) for k, v in t.items()})
    with pytest.raises(CheckpointError, match=r"layers.1.attn.attn_sink has shape \(3,\)"):
        load_model(str(_copy(saved, tmp_path, reshape)), progress=False)

    def floaty(out, files):
        _rewrite(out, files, lambda t: {k: (v.float() if k.endswith("tid2eid") else v) for k, v in t.items()})
    with pytest.raises(CheckpointError, match="tid2eid must hold integers"):
        load_model(str(_copy(saved, tmp_path / "b", floaty)), progress=False)


def test_missing_scale_and_unknown_architecture(saved, tmp_path):
    def noscale(out, files):
        _rewrite(out, files, lambda t: {k: v for k, v in t.items() if k != "layers.0.attn.wo_b.scale"})
    with pytest.raises(CheckpointError, match="layers.0.attn.wo_b.scale"):
        load_model(str(_copy(saved, tmp_path, noscale)), progress=False)

    def arch(out, files):
        c = json.loads((out / "config.json").read_text())
        c["architectures"], c["model_type"] = ["LlamaForCausalLM"], "llama"
        (out / "config.json").write_text(json.dumps(c))
    with pytest.raises(ConfigError, match="unsupported architecture 'llama'"):
        load_model(str(_copy(saved, tmp_path / "c", arch)), progress=False)


def test_vision_tensors_are_skipped_with_a_message(saved, tmp_path, caplog):
    def vision(out, files):
        save_file({"vision.patch_embed.weight": torch.zeros(2, 2)}, str(out / "vision.safetensors"))
        idx = json.loads((out / "model.safetensors.index.json").read_text())
        idx["weight_map"]["vision.patch_embed.weight"] = "vision.safetensors"
        (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    with caplog.at_level("WARNING"):
        load_model(str(_copy(saved, tmp_path, vision)), progress=False)
    assert "skipping 1 tensors of the vision tower" in caplog.text


def test_out_of_vocabulary_ids_and_too_long_prompts_are_rejected(saved):
    model, *_ = saved
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        model(torch.tensor([[5, 384]]))
    small = DeepseekV4ForCausalLM(v4_config(max_position_embeddings=16))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        small(torch.randint(2, 300, (1, 17)))


@torch.no_grad()
def test_v4_0731_dspark_drafter_loads_and_runs(tmp_path):
    from kvcache.engine.models.dspark import greedy_draft, write_context
    cfg = v4_config(compress_ratios=[0, 0, 4, 16, 4, 16, 0, 0, 0], num_nextn_predict_layers=1,
                    dspark_block_size=5, dspark_noise_token_id=300, dspark_target_layer_ids=[3, 4, 5],
                    dspark_markov_rank=16, quantization_config=QUANT)
    model = randomize(DeepseekV4ForCausalLM(cfg), seed=2).eval()
    names = model.state_dict()
    assert names["mtp.0.main_proj.weight"].shape == (64, 3 * 64)
    assert "mtp.2.markov_head.markov_w1.weight" in names and "mtp.2.hc_head_fn" in names
    assert not any(k.startswith("mtp.3") for k in names)
    snap_to_formats(model, cfg)
    save_checkpoint(model, cfg, str(tmp_path))
    loaded, _ = load_model(str(tmp_path), progress=False)
    ids = _ids(24)
    results = []
    for m in (model, loaded):
        state = m.new_state()
        _, positions, taps = m.streams_at(ids, state, collect=(3, 4, 5))
        write_context(m, taps, positions, state.drafter)
        results.append(greedy_draft(m, ids[:, -1], 24, state.drafter))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][0].shape == (1, 5) and ((results[0][1] > 0) & (results[0][1] < 1)).all()
    state = model.new_state()                    # the drafter makes no tensor on torch's default device
    _, positions, taps = model.streams_at(ids, state, collect=(3, 4, 5))
    with torch.device("meta"):                   # (tests/engine/test_device_placement.py explains the check)
        write_context(model, taps, positions, state.drafter)
        tokens, confidence = greedy_draft(model, ids[:, -1], 24, state.drafter)
    assert torch.equal(tokens, results[0][0]) and torch.equal(confidence, results[0][1])
