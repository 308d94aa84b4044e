"""`kvcache model distill` on the tiny V4 demo checkpoint: the drafter learns its target's next
tokens on the corpus it was trained on (acceptance climbs from ~0), the checkpoint is rewritten
with distill.json and still loads, greedy speculation on it gives the plain tokens."""

import json
import shutil

from kvcache.engine.config import EngineConfig
from kvcache.engine.llm import LLM, load_checkpoint
from kvcache.engine.sampling import SamplingParams
from kvcache.engine.speculative.distill import Corpus
from tests.cli.command import kv

CFG = EngineConfig(block_size=16, num_blocks=64, max_running=8)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _accepted(path, prompts, method="mtp"):
    model, _ = load_checkpoint(path)
    plain = [o[0].token_ids for o in LLM(model=model, config=CFG).generate(prompts, GREEDY)]
    llm = LLM(model=model, config=EngineConfig(**{**CFG.__dict__, "speculative": method, "num_draft": 3}))
    spec = [o[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert spec == plain
    return llm.engine.spec.stats


def test_distill_teaches_the_drafter_its_targets_corpus(v4_tiny_checkpoint, tmp_path):
    d = tmp_path / "v4-tiny"
    shutil.copytree(v4_tiny_checkpoint, d)
    prompts = Corpus().prompts(384)[0:8:2]                        # the corpus's greedy prompts
    before = _accepted(str(d), prompts)
    r = kv("model", "distill", "--model", str(d), "--seconds", "600", "--steps", "120")
    assert "first-draft agreement" in r.stdout
    meta = json.loads((d / "distill.json").read_text())
    assert meta["method"] == "mtp" and meta["steps"] > 10 and meta["last_loss"] < meta["first_loss"]
    after = _accepted(str(d), prompts)
    assert after.rates()[0] > max(0.1, 3 * before.rates()[0]), (before.rates(), after.rates())
    bad = kv("model", "distill", "--model", str(d), "--sequences", "4", check=False)
    assert bad.returncode == 2 and "at least 8" in bad.stderr
    bad = kv("model", "distill", "--model", str(d), "--steps", "0", check=False)
    assert bad.returncode == 2 and "--steps must be at least 1" in bad.stderr
