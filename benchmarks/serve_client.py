"""The clients of `kvcache bench serve`: a workload replayed over HTTP against one server, every
request streamed through /v1/completions, timed from the moment it is sent.

    per session (a conversation): its turns in order, each sent at its arrival time or, if the
      previous turn is still answering, when that answer is complete (a user reads the answer
      before the next message); at most `clients` requests in flight over all sessions
    per request: TTFT = the first chunk with text, end to end = the last byte, TPOT = (end to
      end - TTFT) / (completion tokens - 1), prompt / completion / cached tokens from the usage
      chunk; a non-200 status, an error frame, a stream without usage or a dropped connection is
      an error with its reason
    per run: a deadline; what has not finished by then is an error ("deadline")
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Callable

import aiohttp

from kvcache.benchmarks.serve_workload import Turn, Workload


@dataclass(frozen=True)
class Target:
    """A server and how a turn becomes its request body (`body(turn) -> dict`)."""
    name: str
    url: str
    body: Callable[[Turn], dict]


@dataclass
class Outcome:
    session: int
    turn: int
    scheduled_s: float                  # arrival time in the workload
    sent_s: float | None = None         # from the run's start
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None    # None: the server reports none
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


def cached_of(usage: dict) -> int | None:
    details = usage.get("prompt_tokens_details")
    return details.get("cached_tokens") if isinstance(details, dict) else None


async def _read_stream(resp: aiohttp.ClientResponse, out: Outcome, t_sent: float) -> None:
    usage = None
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        frame = json.loads(data)
        if "error" in frame:
            out.error = f"error frame: {str(frame['error'])[:200]}"
            return
        if out.ttft_s is None and any(c.get("text") for c in frame.get("choices") or ()):
            out.ttft_s = time.perf_counter() - t_sent
        usage = frame.get("usage") or usage
    out.e2e_s = time.perf_counter() - t_sent
    if usage is None:
        out.error = "the stream ended without a usage block"
        return
    out.prompt_tokens, out.completion_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
    out.cached_tokens = cached_of(usage)
    if out.ttft_s is None:                 # no text at all (e.g. only special tokens): TTFT is the end
        out.ttft_s = out.e2e_s


async def send(http: aiohttp.ClientSession, target: Target, turn: Turn, out: Outcome, t0: float) -> None:
    t_sent = time.perf_counter()
    out.sent_s = t_sent - t0
    try:
        async with http.post(target.url + "/v1/completions", json=target.body(turn)) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            await _read_stream(resp, out, t_sent)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        out.error = f"{type(e).__name__}: {str(e)[:200]}"


async def _replay(target: Target, workload: Workload, clients: int, deadline_s: float,
                  on_done: Callable[[Outcome], None]) -> list[Outcome]:
    outcomes = {(t.session, t.index): Outcome(t.session, t.index, t.arrival_s) for t in workload.turns}
    slots = asyncio.Semaphore(clients)
    t0 = time.perf_counter()

    async def session(http: aiohttp.ClientSession, turns: list[Turn]) -> None:
        for turn in turns:
            await asyncio.sleep(max(0.0, turn.arrival_s - (time.perf_counter() - t0)))
            out = outcomes[(turn.session, turn.index)]
            async with slots:
                await send(http, target, turn, out, t0)
            on_done(out)

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        tasks = [asyncio.create_task(session(http, s)) for s in workload.sessions]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for out in outcomes.values():
        if out.e2e_s is None and out.error is None:
            out.error = f"deadline: not finished {deadline_s:g} s after the run started"
    return sorted(outcomes.values(), key=lambda o: (o.scheduled_s, o.session, o.turn))


def replay(target: Target, workload: Workload, clients: int, deadline_s: float,
           on_done: Callable[[Outcome], None] = lambda o: None) -> tuple[list[Outcome], float]:
    """Every turn's outcome, and the run's wall time (start to the last answer or the deadline)."""
    t0 = time.perf_counter()
    outcomes = asyncio.run(_replay(target, workload, clients, deadline_s, on_done))
    return outcomes, time.perf_counter() - t0


async def _one(target: Target, turn: Turn) -> Outcome:
    out = Outcome(-1, 0, 0.0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await send(http, target, turn, out, time.perf_counter())
    return out


def request_once(target: Target, turn: Turn) -> Outcome:
    """One request outside any run (a warm-up, or the probe of what a server can do)."""
    return asyncio.run(_one(target, turn))
