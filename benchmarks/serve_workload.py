"""The multi-turn workload `kvcache bench serve` replays, derived from the Mooncake conversation
trace (/work/shared/traces/README.md: one request a line, `hash_ids` one id per 512-token block,
equal ids at equal positions a shared prefix).

    trace rows ─ sessions: a request that starts with >= 2 blocks of an earlier one continues
                 that request's session (a conversation's next turn, or another question on
                 the same document); sessions with >= 2 turns, in order of their first arrival
               ─ per turn: arrival (trace time x time_scale), prompt = BOS + the tokens of its
                 hash ids (block_tokens per trace block, the last block scaled like the rest),
                 max_tokens = output_length scaled the same way, capped
               ─ ideal cached tokens: the longest prefix it shares with an earlier turn's
                 prompt, floored to the cache's hit unit (exact mode: its snapshot interval):
                 what an unbounded cache can give

Each hash id's tokens are drawn from a generator seeded by (seed, id), so equal ids are equal
tokens and every prefix the trace shares is shared token for token. The tokens are "words": ids
whose text is a space and letters and that encode back to themselves alone, so any sequence of
them decodes to text that the checkpoint's byte-level BPE encodes to the very same ids (the
pre-tokenizer cuts before every space); transformers serve, which takes text only, gets that text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

TRACE_BLOCK = 512               # tokens per hash id in the trace
SESSION_MIN_BLOCKS = 2          # block 0 is everyone's system prompt: a session shares more than that


@dataclass(frozen=True)
class WorkloadShape:
    """How the trace is cut down to what the machine can serve."""
    block_tokens: int = 48              # tokens per trace block (the trace's are 512)
    max_requests: int = 32
    max_turns: int = 8                  # turns kept per session (its first ones)
    max_prompt_tokens: int = 3072       # a session is cut before its first turn past this
    max_output_tokens: int = 32
    time_scale: float = 0.01            # seconds of replay per second of trace
    seed: int = 0

    def __post_init__(self):
        assert self.block_tokens >= 1 and self.max_requests >= 1 and self.max_turns >= 1
        assert self.max_output_tokens >= 1 and self.time_scale >= 0

    def scaled(self, trace_tokens: int) -> int:
        return max(1, -(-trace_tokens * self.block_tokens // TRACE_BLOCK))


@dataclass(frozen=True)
class Turn:
    session: int
    index: int                          # 0: the session's first turn
    arrival_s: float                    # from the replay's start
    prompt_ids: list[int] = field(repr=False)
    max_tokens: int
    ideal_cached: int                   # tokens an unbounded prefix cache can serve (whole hit units)


@dataclass(frozen=True)
class Workload:
    shape: WorkloadShape
    sessions: list[list[Turn]]
    trace_rows: list[int]               # the trace lines the turns come from, in turn order

    @property
    def turns(self) -> list[Turn]:
        return sorted((t for s in self.sessions for t in s), key=lambda t: (t.arrival_s, t.session, t.index))

    def stats(self) -> dict:
        turns = self.turns
        prompt = [len(t.prompt_ids) for t in turns]
        return {"requests": len(turns), "sessions": len(self.sessions),
                "first_turns": sum(t.index == 0 for t in turns),
                "prompt_tokens": {"total": sum(prompt), "min": min(prompt), "median": int(np.median(prompt)),
                                  "max": max(prompt)},
                "output_tokens_total": sum(t.max_tokens for t in turns),
                "arrival_span_s": max(t.arrival_s for t in turns),
                "ideal_cached_fraction": sum(t.ideal_cached for t in turns) / sum(prompt)}


def word_ids(tokenizer) -> list[int]:
    """Token ids whose text is ' letters' and that encode back to themselves alone."""
    words = []
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([i])
        if re.fullmatch(r" [A-Za-z]+", text) and tokenizer.encode(text) == [i]:
            words.append(i)
    if len(words) < 2:
        raise ValueError(f"the tokenizer has {len(words)} single-token words; the workload needs at least 2")
    return words


def read_trace(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def sessions_of(rows: list[dict]) -> list[list[int]]:
    """Row indices grouped into sessions, each in arrival order, sessions by first arrival."""
    trie: dict = {}
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        node, owner = trie, None
        for depth, h in enumerate(row["hash_ids"], 1):
            if h not in node:
                break
            node = node[h]
            if depth >= SESSION_MIN_BLOCKS:
                owner = node["_session"]
        owner = i if owner is None else owner
        groups.setdefault(owner, []).append(i)
        node = trie
        for depth, h in enumerate(row["hash_ids"], 1):
            node = node.setdefault(h, {})
            node.setdefault("_session", owner)
    return [g for _, g in sorted(groups.items(), key=lambda kv: rows[kv[1][0]]["timestamp"])]


class BlockTokens:
    """The tokens of each hash id: block_tokens words drawn with the generator seeded (seed, id)."""

    def __init__(self, words: list[int], block_tokens: int, seed: int):
        self.words, self.block_tokens, self.seed = np.asarray(words), block_tokens, seed

    def __call__(self, hash_id: int, n: int) -> list[int]:
        rng = np.random.default_rng([self.seed, hash_id])
        return self.words[rng.integers(0, len(self.words), self.block_tokens)][:n].tolist()


def prompt_of(row: dict, tokens: BlockTokens, shape: WorkloadShape, bos: int) -> list[int]:
    ids, hashes = [bos], row["hash_ids"]
    last = shape.scaled(row["input_length"] - TRACE_BLOCK * (len(hashes) - 1))
    for j, h in enumerate(hashes):
        ids += tokens(h, shape.block_tokens if j < len(hashes) - 1 else min(last, shape.block_tokens))
    return ids


def _shared(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def _ideal(prompt: list[int], earlier: list[list[int]], hit_unit: int) -> int:
    """Whole hit units of the longest prefix shared with an earlier prompt; never the last
    token, which is computed to give the first output's logits."""
    best = max((_shared(prompt, e) for e in earlier), default=0)
    return min(best, len(prompt) - 1) // hit_unit * hit_unit


def build_workload(rows: list[dict], tokenizer, shape: WorkloadShape, hit_unit: int) -> Workload:
    tokens = BlockTokens(word_ids(tokenizer), shape.block_tokens, shape.seed)
    picked: list[list[tuple[int, list[int]]]] = []
    count = 0
    for group in sessions_of(rows):
        if len(group) < 2:
            continue
        kept = []
        for i in group[:shape.max_turns]:
            ids = prompt_of(rows[i], tokens, shape, tokenizer.bos_id)
            if len(ids) > shape.max_prompt_tokens or count + len(kept) >= shape.max_requests:
                break
            kept.append((i, ids))
        if len(kept) >= 2 or (kept and count + len(kept) >= shape.max_requests):
            picked.append(kept)
            count += len(kept)
        if count >= shape.max_requests:
            break
    return _timed(rows, picked, shape, hit_unit)


def _timed(rows: list[dict], picked: list[list[tuple[int, list[int]]]], shape: WorkloadShape,
           hit_unit: int) -> Workload:
    """Arrival times from the first picked request, ideal hits against every earlier arrival."""
    t0 = min(rows[i]["timestamp"] for s in picked for i, _ in s)
    order = sorted((rows[i]["timestamp"], i, ids) for s in picked for i, ids in s)
    ideal, seen = {}, []
    for _, i, ids in order:
        ideal[i] = _ideal(ids, seen, hit_unit)
        seen.append(ids)
    sessions = [[Turn(n, k, (rows[i]["timestamp"] - t0) / 1000 * shape.time_scale, ids,
                      min(shape.max_output_tokens, shape.scaled(rows[i]["output_length"])), ideal[i])
                 for k, (i, ids) in enumerate(s)] for n, s in enumerate(picked)]
    return Workload(shape, sessions, [i for _, i, _ in order])


def prompt_text(turn: Turn, tokenizer, bos_text: str) -> str:
    """The prompt as text, BOS spelled as its special token (transformers serve takes text only)."""
    return bos_text + tokenizer.decode(turn.prompt_ids[1:])
