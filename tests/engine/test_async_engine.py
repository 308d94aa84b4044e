"""The async engine's event loop never waits for a step: while a step runs, the loop keeps
turning, submissions and aborts are messages the engine thread reads after the step, validation
errors still raise in generate, and a step that raises fails only the requests it was running.

A step here is held at a gate the test opens: "the loop ran N iterations during the step" is
then a count, not a wall-clock bound. The gate's timeout only ends a failing run (an event loop
that blocked on the step would never open it)."""

import asyncio
import threading

import pytest
import torch

from kvcache.engine.async_engine import AsyncEngine
from kvcache.engine.config import EngineConfig
from kvcache.engine.llm import LLM
from kvcache.engine.llm_engine import LLMEngine
from kvcache.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from kvcache.engine.sampling import SamplingParams
from tests.engine.tiny import randomize, v4_config

CFG = EngineConfig(block_size=16, num_blocks=64, max_tokens_per_step=48, max_running=8)
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
TICKS = 20                      # event-loop iterations the test runs while the step is held
GATE_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def model():
    return randomize(DeepseekV4ForCausalLM(v4_config(num_nextn_predict_layers=0)), seed=1).eval()


def _prompts(k: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    return [torch.randint(3, 380, (20,), generator=g).tolist() for _ in range(k)]


class HeldStep:
    """Wraps an engine's step: its first call does the step's work, then waits at a gate before
    it returns (or raises `error`), so the requests it ran hold their blocks meanwhile."""

    def __init__(self, engine: LLMEngine, error: Exception | None = None):
        self.real, self.error = engine.step, error
        self.entered, self.gate = threading.Event(), threading.Event()
        self.calls, self.running = 0, False
        engine.step = self

    def __call__(self):
        self.calls += 1
        if self.calls > 1:
            return self.real()
        self.running = True
        try:
            outs = self.real()
            self.entered.set()
            self.gate.wait(timeout=GATE_TIMEOUT_S)
            if self.error is not None:
                raise self.error
            return outs
        finally:
            self.running = False

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, GATE_TIMEOUT_S), "the engine never stepped"

    async def ticks_while_held(self) -> int:
        """Turn the event loop TICKS times, counting the turns the step was still running, then open the gate."""
        during = 0
        for _ in range(TICKS):
            await asyncio.sleep(0.01)
            during += self.running
        self.gate.set()
        return during


async def _collect(stream) -> list:
    return [out async for out in stream]


def _tokens(outs) -> list[int]:
    return [t for out in outs for t in out.new_tokens]


async def test_the_loop_turns_during_a_step_and_an_abort_takes_effect_after_it(model):
    a, b = _prompts(2)
    want = LLM(model=model, config=CFG).generate([b], GREEDY)[0][0].token_ids
    engine = LLMEngine(model, None, CFG)
    held = HeldStep(engine)
    async with AsyncEngine(engine) as aeng:
        first = asyncio.ensure_future(_collect(aeng.generate(a, LONG, request_id="a")))
        await held.wait_entered()                      # the thread is inside the first step (a's prefill)
        second = asyncio.ensure_future(_collect(aeng.generate(b, GREEDY, request_id="b")))
        aeng.abort("a")
        await asyncio.sleep(0)                         # b's generate runs up to its first wait
        assert "b" not in engine.requests and not engine.requests["a"].finished   # both wait for the step
        assert await held.ticks_while_held() == TICKS
        outs_a, outs_b = await asyncio.wait_for(asyncio.gather(first, second), timeout=60)
    assert outs_a[0].new_tokens and not outs_a[0].finished          # the step a was in ran to its end
    assert outs_a[-1].finished and outs_a[-1].request.finish_reason.value == "abort"
    assert len(_tokens(outs_a)) == 1                                  # aborted right after that step
    assert _tokens(outs_b) == want
    assert not engine.requests
    engine.check_idle()


async def test_a_consumer_that_leaves_during_a_step_frees_its_blocks_after_it(model):
    [a] = _prompts(1)
    engine = LLMEngine(model, None, CFG)
    held = HeldStep(engine)
    async with AsyncEngine(engine) as aeng:
        stream = aeng.generate(a, LONG, request_id="a")
        task = asyncio.ensure_future(stream.__anext__())
        await held.wait_entered()
        task.cancel()                                  # the consumer goes away mid-step
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.requests["a"].block_ids          # the abort is queued behind the step
        assert await held.ticks_while_held() == TICKS
        for _ in range(500):
            if not engine.requests:
                break
            await asyncio.sleep(0.01)
    assert not engine.requests
    engine.check_idle()


async def test_validation_errors_raise_in_generate_while_a_step_runs(model):
    a, b = _prompts(2)
    engine = LLMEngine(model, None, CFG)
    engine.add_request(b, GREEDY, request_id="taken")     # the engine's own, not the async engine's
    held = HeldStep(engine)
    async with AsyncEngine(engine) as aeng:
        first = asyncio.ensure_future(_collect(aeng.generate(a, GREEDY, request_id="a")))
        await held.wait_entered()
        for prompt, kw in (([], {}), ([10 ** 6], {}), (a, {"request_id": "a"}), (a, {"cache_points": [0]})):
            with pytest.raises(ValueError):
                await aeng.generate(prompt, GREEDY, **kw).__anext__()     # at once: the step is still held
        assert held.running
        refused = asyncio.ensure_future(aeng.generate(a, GREEDY, request_id="taken").__anext__())
        assert await held.ticks_while_held() == TICKS
        with pytest.raises(ValueError, match="already in use"):      # the thread refused it, after the step
            await asyncio.wait_for(refused, timeout=60)
        assert _tokens(await asyncio.wait_for(first, timeout=60))
    assert set(engine.requests) == {"taken"} and engine.requests["taken"].finished
    engine.check_idle()


async def test_a_step_that_raises_fails_only_the_requests_it_was_running(model):
    a, b = _prompts(2)
    want = LLM(model=model, config=CFG).generate([b], GREEDY)[0][0].token_ids
    engine = LLMEngine(model, None, CFG)
    held = HeldStep(engine, RuntimeError("scheduler bug"))
    async with AsyncEngine(engine) as aeng:
        first = asyncio.ensure_future(_collect(aeng.generate(a, GREEDY, request_id="a")))
        await held.wait_entered()
        second = asyncio.ensure_future(_collect(aeng.generate(b, GREEDY, request_id="b")))   # sent mid-step
        assert await held.ticks_while_held() == TICKS
        outs_a, outs_b = await asyncio.wait_for(asyncio.gather(first, second), timeout=60)
    assert outs_a[-1].finished and "scheduler bug" in outs_a[-1].request.error and not _tokens(outs_a)
    assert _tokens(outs_b) == want and outs_b[-1].request.error is None
    engine.check_idle()
