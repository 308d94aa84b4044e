"""The engine on a CUDA device (skipped without one; CI has none: run on a GPU machine with
`pytest tests/engine/test_accelerator.py`). On the CPU, tests/engine/test_device_placement.py checks
that no tensor lands off the model's device.

    fp32 on the device == the CPU engine        same greedy tokens, logits within 1e-3
    bf16 (the accelerator default)              as close to fp32 as transformers' V4 in bf16
    batched == one by one                       greedy tokens, fp32
    exact prefix reuse                          warm logits == cold logits bit for bit, bf16
    compiled (Triton) == eager                  greedy tokens, logits within 1e-3, fp32
    CUDA graphs (planned decode replayed)         greedy tokens, logits within 1e-3 of no graphs,
                                                eager and compiled, fp32; bf16 graphs captured
"""

import copy
import dataclasses

import pytest
import torch

from kvcache.engine.llm import LLM
from kvcache.engine.config import EngineConfig
from kvcache.engine.models import build_model
from kvcache.engine.sampling import SamplingParams
from tests.engine.test_engine import model  # noqa: F401  (the v4 / v41 tiny model fixture)
from tests.engine.tiny import randomize, v4_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CFG = EngineConfig(block_size=16, num_blocks=64, max_tokens_per_step=48, max_running=4)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# requests of different lengths: decode batches shrink 4 -> 2 -> 1 as they finish and the longest
# outgrows 4 blocks, so CUDA graphs meet several (batch, blocks) buckets (equal lengths meet one)
STAGGERED = [dataclasses.replace(GREEDY, max_tokens=n) for n in (70, 30, 12, 45)]


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 comparisons mean fp32 matmuls, not TF32."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _prompts(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [[5 + i] + torch.randint(3, 300, (n,), generator=g).tolist() for i, n in enumerate((40, 7, 23, 1))]


def _on(model, dtype):
    return copy.deepcopy(model).to("cuda", dtype)


def _generate(model, prompts, config=CFG, params=GREEDY):
    """Greedy tokens and every sampled position's logits (host copies, by request and position)."""
    llm = LLM(model=model, config=config)
    seen = {}
    llm.engine.logits_hook = lambda req, pos, logits: seen.__setitem__((req.prompt[0], pos), logits.float().cpu())
    outs = llm.generate(prompts, params)
    return [o[0].token_ids for o in outs], seen


@torch.no_grad()
def test_fp32_on_the_device_matches_the_cpu(model):
    ps = _prompts()
    want_tokens, want = _generate(model, ps)
    got_tokens, got = _generate(_on(model, torch.float32), ps)
    assert got_tokens == want_tokens
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-3, atol=1e-3)


@torch.no_grad()
def test_bf16_on_the_device_is_as_close_to_fp32_as_transformers():
    """bf16 weights drift from fp32, on random tiny models a lot for some prompts (cosine 0.77 to
    the fp32 logits, for transformers' V4 as for ours, on the CPU). So the reference is
    transformers' DeepseekV4 in bf16 on the same device: the engine's first-token logits (bf16)
    must be about as close to the fp32 ones as transformers' are."""
    from kvcache.benchmarks.model import hf_twin
    config = v4_config(num_nextn_predict_layers=0)
    cpu = randomize(build_model(config), 1).eval()
    hf = hf_twin(cpu, config).to("cuda", torch.bfloat16)
    ps = _prompts(2)
    _, ref = _generate(cpu, ps)
    _, ours = _generate(_on(cpu, torch.bfloat16), ps)
    err_ours, err_hf = [], []
    for p in ps:
        k = (p[0], len(p))
        theirs = hf(input_ids=torch.tensor([p], device="cuda")).logits[0, -1].float().cpu()
        err_ours.append(1 - float(torch.nn.functional.cosine_similarity(ours[k], ref[k], dim=0)))
        err_hf.append(1 - float(torch.nn.functional.cosine_similarity(theirs, ref[k], dim=0)))
    assert sum(err_ours) <= 1.5 * sum(err_hf) + 4e-3, (err_ours, err_hf)


@torch.no_grad()
def test_batched_equals_one_by_one_on_the_device(model):
    m = _on(model, torch.float32)
    ps = _prompts(3)
    batched, _ = _generate(m, ps)
    alone = [_generate(m, [p])[0][0] for p in ps]
    assert batched == alone


@torch.no_grad()
def test_exact_prefix_reuse_is_bit_identical_on_the_device(model, tmp_path):
    """bf16 block lanes and fp32 window/carry slots: a warm request resumed from the store's blocks
    and tail snapshot gives the cold run's logits bit for bit."""
    from tests.engine.prefix_cache_setup import CFG as CACHE_CFG, cached, open_store, prompts, run, tap_logits
    m = _on(model, torch.bfloat16)
    P, Qs = prompts(7, n_questions=2)
    store = open_store(tmp_path)
    with LLM(model=m, config=cached("exact"), store=store) as first:
        run(first, [P + Qs[0]])
    cold, warm = {}, {}
    plain = LLM(model=m, config=CACHE_CFG)
    tap_logits(plain, cold, 1)
    plain.generate([P + Qs[1]], GREEDY)
    with LLM(model=m, config=cached("exact"), store=store) as again:
        tap_logits(again, warm, 1)
        _, usage = run(again, [P + Qs[1]])
    store.close()
    assert usage[0].cached_tokens == {"dram": 96}
    assert cold.keys() == warm.keys()
    assert all(torch.equal(cold[k], warm[k]) for k in cold)


@torch.no_grad()
def test_compiled_matches_eager_on_the_device():
    """Inductor's Triton kernels per phase, with the start-up warm-up: same greedy tokens as eager."""
    torch._dynamo.reset()
    m = randomize(build_model(v4_config(num_nextn_predict_layers=0)), 3).eval().to("cuda")
    ps = _prompts(4)
    want_tokens, want = _generate(m, ps)
    got_tokens, got = _generate(m, ps, dataclasses.replace(CFG, compile=True))
    assert got_tokens == want_tokens
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-3, atol=1e-3)


def _graph_decode_steps(llm) -> int:
    return len(llm.engine.decode_graphs.graphs)


@torch.no_grad()
@pytest.mark.timeout(900)        # compiled: two engines' start-up compiles
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graphs_match_the_uncaptured_steps(compiled):
    """Decode steps replayed from CUDA graphs (padded to their bucket) give the tokens and logits
    of the same engine without graphs; graphs were really captured and replayed."""
    model = randomize(build_model(v4_config(num_nextn_predict_layers=0)), 3).eval()
    dev = _on(model, torch.float32)
    base = dataclasses.replace(CFG, device_experts=True, compile=compiled)
    ref_tokens, ref_logits = _generate(dev, _prompts(), base, STAGGERED)
    llm = LLM(model=dev, config=dataclasses.replace(base, cuda_graphs=True))
    seen = {}
    llm.engine.logits_hook = lambda req, pos, logits: seen.__setitem__((req.prompt[0], pos), logits.float().cpu())
    tokens = [o[0].token_ids for o in llm.generate(_prompts(), STAGGERED)]
    assert llm.engine.decode_graphs.failed is None
    assert _graph_decode_steps(llm) >= 3                      # buckets: 4 requests down to 1, 4 and 8 blocks
    assert tokens == ref_tokens
    for k, ref in ref_logits.items():
        torch.testing.assert_close(seen[k], ref, rtol=1e-3, atol=1e-3)


@torch.no_grad()
def test_cuda_graphs_in_bf16_capture_and_agree():
    model = randomize(build_model(v4_config(num_nextn_predict_layers=0)), 3).eval()
    dev = _on(model, torch.bfloat16)
    base = dataclasses.replace(CFG, device_experts=True)
    ref_tokens, _ = _generate(dev, _prompts(), base, STAGGERED)
    llm = LLM(model=dev, config=dataclasses.replace(base, cuda_graphs=True))
    tokens = [o[0].token_ids for o in llm.generate(_prompts(), STAGGERED)]
    assert llm.engine.decode_graphs.failed is None
    assert _graph_decode_steps(llm) >= 3
    same = sum(a == b for x, y in zip(tokens, ref_tokens) for a, b in zip(x, y))
    assert same >= 0.5 * sum(len(x) for x in ref_tokens)     # bf16 rounding differs with the padded shapes
