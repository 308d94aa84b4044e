"""`kvcache model init | logits | info` and `kvcache generate` through the command line's main():
the same parsing, output and exit status as from a shell. Real processes where the process is the
point: tensor-parallel ranks, a second process seeded alike or reading the first's cache."""

import hashlib
import json
import os
import stat

import numpy as np
import pytest
import torch

from kvcache.engine.checkpoint.loader import load_model
from kvcache.engine.tokenizer import load_tokenizer
from tests.cli.command import kv, kv_process


def _digest(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_init_is_deterministic_and_logits_match_the_loaded_model(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    out = kv("model", "init", "--config", "v4-tiny", "--out", str(a), "--seed", "7").stdout
    assert "deepseek_v4 checkpoint" in out
    kv("model", "init", "--config", "v4-tiny", "--out", str(b), "--seed", "7")
    kv("model", "init", "--config", "v4-tiny", "--out", str(c), "--seed", "8")
    assert _digest(a) == _digest(b) and _digest(a) != _digest(c)
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= set(_digest(a))
    ids = [0, 17, 42, 99, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 300]
    kv("model", "logits", "--model", str(a), "--prompt-ids", ",".join(map(str, ids)), "--out", str(tmp_path / "l.npy"))
    got = np.load(tmp_path / "l.npy")
    model, config = load_model(str(a), progress=False)
    with torch.no_grad():
        want = model(torch.tensor([ids]))[0].numpy()
    assert got.dtype == np.float32 and got.shape == (len(ids), config.vocab_size) and np.array_equal(got, want)
    tok = load_tokenizer(str(a))
    assert tok.bos_id == 0 and tok.eos_id == 1 and tok.vocab_size <= config.vocab_size
    assert tok.decode(tok.encode("prefix caching")) == "prefix caching"


def test_init_gives_every_file_the_mode_of_the_users_umask(tmp_path):
    # safetensors alone writes the shards 0600: the other files follow the umask
    old = os.umask(0o027)
    try:
        kv("model", "init", "--config", "v4-tiny", "--out", str(tmp_path / "m"))
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "m").iterdir()}
    assert any(n.endswith(".safetensors") for n in modes) and set(modes.values()) == {0o640}, modes


@torch.no_grad()
def test_logits_of_a_checkpoint_saved_by_transformers(tmp_path):
    """`model logits` on what the installed transformers' `save_pretrained` writes (5.24: its save
    names, its config.json) gives transformers' logits. 17 tokens fill no indexer past its top-k
    (4 entries of 4 tokens), so no index-score tie can order the picks differently."""
    pytest.importorskip("transformers")
    from transformers import DeepseekV4ForCausalLM
    from tests.engine.test_v4_vs_transformers import hf_config
    torch.manual_seed(0)
    hf = DeepseekV4ForCausalLM(hf_config()).eval()
    hf.save_pretrained(str(tmp_path / "hf"))
    ids = [0, 17, 42, 99, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 300]
    kv("model", "logits", "--model", str(tmp_path / "hf"), "--prompt-ids", ",".join(map(str, ids)),
       "--out", str(tmp_path / "l.npy"))
    got, want = np.load(tmp_path / "l.npy"), hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_bad_inputs_are_clear_errors(tmp_path, v4_tiny_checkpoint):
    r = kv("model", "logits", "--model", str(tmp_path), "--prompt-ids", "1,2", "--out", "x.npy", check=False)
    assert r.returncode == 2 and "config.json" in r.stderr
    r = kv("model", "init", "--config", "no-such-model", "--out", str(tmp_path / "x"), check=False)
    assert r.returncode == 2 and "v4-tiny" in r.stderr
    m, out = str(v4_tiny_checkpoint), str(tmp_path / "x.npy")
    r = kv("model", "logits", "--model", m, "--prompt-ids", "1,a", "--out", out, check=False)
    assert r.returncode == 2 and "comma-separated integers" in r.stderr
    r = kv("model", "logits", "--model", m, "--prompt-ids", "1,999", "--out", out, check=False)
    assert r.returncode == 2 and "outside the model's vocabulary" in r.stderr


def test_info_of_the_real_flash_config():
    facts = json.loads(kv("model", "info", "v4-flash", "--json").stdout)
    assert facts["parameters"] == 290_942_289_362               # incl. the MTP block, as counted upstream
    kinds = facts["layer_kinds"]
    assert kinds.count("csa") == 21 and kinds.count("hca") == 20 and kinds[:2] == ["swa", "swa"]
    per_token = facts["kv_history_bytes_per_token"]
    assert per_token["bf16"] == 6880                             # 21 x (1024/4 + 256/4) + 20 x 1024/128
    assert round(per_token["fp8_ds_mla+fp8_index"]) == 3850 and round(per_token["fp8_ds_mla+mxfp4_index"]) == 3514
    text = kv("model", "info", "v4-flash").stdout
    assert "6880.0 B/token" in text and "290,942,289,362" in text


def test_generate_streams_and_is_reproducible_with_a_seed(v4_tiny_checkpoint):
    d = v4_tiny_checkpoint
    args = ("generate", "--model", str(d), "--prompt", "A prefix cache", "--max-tokens", "8", "--temperature", "0.8",
            "--seed", "11", "--ignore-eos")
    a, b = kv(*args), kv_process(*args)                          # the seed alone decides: not the process
    assert a.stdout == b.stdout and a.stdout.strip()
    assert "8 generated" in a.stderr and "time to first token" in a.stderr
    r = kv("generate", "--model", str(d), "--prompt-ids", "1,2,x", check=False)
    assert r.returncode == 2 and "comma-separated integers" in r.stderr
    r = kv("generate", "--model", str(d), "--prompt", "hi", "--top-p", "0", check=False)
    assert r.returncode == 2 and "top_p" in r.stderr
    r = kv("generate", "--model", str(d), "--prompt", "hi", "--compile", "--tp", "2", check=False)
    assert r.returncode == 2 and "--compile does not support tensor" in r.stderr


def test_generate_speculative_gives_the_same_greedy_tokens(v4_tiny_checkpoint):
    d = v4_tiny_checkpoint
    base = ("generate", "--model", str(d), "--prompt", "A prefix cache", "--max-tokens", "10", "--ignore-eos")
    plain, spec = kv(*base), kv(*base, "--speculative", "mtp", "--num-draft", "2")
    assert spec.stdout == plain.stdout and "[speculative mtp:" in spec.stderr and "10 generated" in spec.stderr
    assert kv(*base, "--async-scheduling").stdout == plain.stdout
    r = kv(*base, "--speculative", "dspark", check=False)                 # V4-tiny has MTP, not DSpark
    assert r.returncode == 2 and "DSpark speculation needs" in r.stderr
    r = kv(*base, "--speculative", "mtp", "--num-draft", "-1", check=False)
    assert r.returncode == 2 and "num_draft" in r.stderr


def test_generate_with_two_tensor_parallel_ranks_matches_one(v4_tiny_checkpoint):
    d = v4_tiny_checkpoint
    # greedy: sampled tokens could flip on a draw that lands within float rounding of a CDF step, and
    # the ranks' partial sums are not bit-identical to one process (the logits agree to 1e-5:
    # tests/engine/test_parallel.py)
    base = ("generate", "--model", str(d), "--prompt", "A prefix cache", "--max-tokens", "6", "--ignore-eos")
    one = kv(*base)
    two = kv_process(*base, "--tp", "2", "--ep")                # ranks are processes: a real parent spawns them
    assert one.stdout == two.stdout and "6 generated" in two.stderr
    # a rank's bad input: one clear line and exit status 2, as without --tp (no rank's traceback). The
    # parent says it after the ranks are gone: a rank that said it could be SIGTERMed first (CI, once)
    bad = kv_process("generate", "--model", str(d), "--prompt-ids", "1,2,999999", "--tp", "2", check=False)
    assert bad.returncode == 2 and bad.stderr.count("error:") == 1 and "999999" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and "SIGTERM" not in bad.stderr, bad.stderr


def test_generate_with_a_cache_directory_reuses_the_prefix_exactly(tmp_path, v4_tiny_checkpoint):
    ids = ",".join(str(3 + i % 300) for i in range(600))
    base = ["generate", "--model", str(v4_tiny_checkpoint), "--prompt-ids", ids, "--max-tokens", "6"]
    plain = kv(*base)
    cache = ["--cache", str(tmp_path / "store"), "--cache-mode", "exact"]
    first, second = kv(*base, *cache), kv_process(*base, *cache)  # another process derives the same keys: NVMe hits
    tokens = lambda r: r.stdout.strip()  # noqa: E731
    assert tokens(first) == tokens(second) == tokens(plain)
    assert "cached (none)" in first.stderr and "512 of 600 prompt tokens cached (nvme 512)" in second.stderr
