"""What the prefix-cache tests share: a small engine config, documents with questions after
them, engines with a cache, an in-process store, and taps on the logits an engine computes."""

import dataclasses

import torch

from kvcache.engine.config import CacheConfig, EngineConfig
from kvcache.engine.llm import LLM
from kvcache.engine.sampling import SamplingParams
from kvcache.kvstore.config import StoreConfig
from kvcache.kvstore.store import BlockStore
from kvcache.tiering.config import DramConfig, NvmeConfig

CFG = EngineConfig(block_size=16, num_blocks=128, max_tokens_per_step=48, max_running=8)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def prompts(seed: int, n_questions: int = 3, doc: int = 96):
    g = torch.Generator().manual_seed(seed)
    P = torch.randint(3, 380, (doc,), generator=g).tolist()
    return P, [torch.randint(3, 380, (7,), generator=g).tolist() for _ in range(n_questions)]


def cold(model, ps):
    return [LLM(model=model, config=CFG).generate([p], GREEDY)[0][0].token_ids for p in ps]


def cached(mode: str, **kw) -> EngineConfig:
    if mode == "exact":
        kw.setdefault("snapshot_interval", 48)          # snapshot points at 48 and 96 (the document's end)
    return dataclasses.replace(CFG, cache=CacheConfig(mode=mode, **kw))


def open_store(path) -> BlockStore:
    return BlockStore(StoreConfig(str(path), dram=DramConfig(capacity_bytes=64 << 20, page_bytes=1 << 20,
                                                             prefault=False),
                                  nvme=NvmeConfig(segment_bytes=4 << 20)))


def run(llm, ps):
    outs = [llm.generate([p], GREEDY)[0][0] for p in ps]
    return outs, [o.usage for o in outs]


def filled_store(model, tmp_path, seed: int, n_questions: int = 3):
    """(document, questions, store): the store holds an exact-mode run of the first question."""
    P, Qs = prompts(seed, n_questions)
    store = open_store(tmp_path)
    with LLM(model=model, config=cached("exact"), store=store) as first:
        run(first, [P + Qs[0]])
    return P, Qs, store


def tap_logits(llm, into: dict, key) -> None:
    """Keep the first logits the engine computes for each (key, position) in `into`."""
    llm.engine.logits_hook = lambda req, pos, logits: into.setdefault((key, pos), logits.clone())


def serve(llm, prompt, params=GREEDY, **kw):
    """One request alone on `llm`'s engine, run to its end (`kw`: add_request's cache_salt,
    cache_points): the finished Request, its usage and block keys still on it."""
    engine = llm.engine
    req = engine.add_request(prompt, params, **kw)
    while engine.has_work():
        engine.step()
    return req
