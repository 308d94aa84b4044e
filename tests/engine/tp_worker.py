"""Runs in each spawned rank: build the tiny models from the same seed, shard, run, save results."""

import os

import torch
import torch.distributed as dist


def build(kind: str):
    from kvcache.engine.layers.engram import compressed_token_map
    from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from kvcache.engine.models.deepseek_v41 import DeepseekV41ForCausalLM
    from kvcache.engine.tokenizer import build_demo_tokenizer
    from tests.engine.tiny import randomize, v4_config, v41_config
    if kind == "v4":
        return randomize(DeepseekV4ForCausalLM(v4_config(num_nextn_predict_layers=0)), seed=5).eval()
    tm = compressed_token_map(build_demo_tokenizer(512))
    m = randomize(DeepseekV41ForCausalLM(v41_config(int(tm.max()) + 1, num_nextn_predict_layers=0)), seed=5)
    m.set_token_map(tm)
    return m.eval()


def run(kind: str, shard_mode: str | None, rank: int, world: int):
    from kvcache.engine.llm import LLM
    from kvcache.engine.config import EngineConfig
    from kvcache.engine.parallel import shard
    from kvcache.engine.sampling import SamplingParams
    model = build(kind)
    if shard_mode:
        shard(model, rank, world, tp="tp" in shard_mode, ep="ep" in shard_mode)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 380, (1, 37), generator=g)
    with torch.no_grad():
        logits = model(prompt)
    llm = LLM(model=model, config=EngineConfig(block_size=16, num_blocks=32, max_tokens_per_step=32, max_running=4))
    ps = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (9, 30, 17)]
    # greedy: robust to 1e-7 noise
    outs = llm.generate(ps, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return logits, [o[0].token_ids for o in outs]


def worker(rank: int, world: int, rendezvous: str, out_dir: str, modes: list[str]):
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for kind in ("v4", "v41"):
            for mode in modes:
                logits, toks = run(kind, mode, rank, world)
                if rank == 0:
                    torch.save({"logits": logits, "tokens": toks}, os.path.join(out_dir, f"{kind}-{mode}.pt"))
        # both ranks done before either tears down: a rank leaving while its peer still talks
        # over gloo aborted one in ~1 run of 8 ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()
