"""A request: its tokens, its sampling parameters, where it is, and what it holds."""

from __future__ import annotations

import enum
import itertools
import numbers
import time
from dataclasses import dataclass, field

from kvcache.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"              # queued (new, or preempted and to be recomputed)
    WAITING_FOR_KV = "waiting_for_kv"  # prefix blocks loading from the store: not schedulable
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"                    # a stop token or stop string
    ABORT = "abort"
    ERROR = "error"


_ids = itertools.count()


@dataclass
class Metrics:
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    tokens_computed: int = 0         # prefill + decode tokens run through the model (recompute counted)
    preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def tpot_s(self, output_tokens: int) -> float | None:
        if self.first_token is None or self.finished is None or output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (output_tokens - 1)


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    priority: int = 0                # lower runs first; ties by arrival
    request_id: str = ""
    stream: int = 0                  # which of the n samples this is (keys its random draws)
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    state: object = None             # the model's per-request KV state (engine.models ModelState)
    num_computed: int = 0            # tokens whose KV the state holds
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)   # content keys of its full, computed blocks
    # content keys of every full block of the prompt, hashed once when the request is added: the
    # pool's keys and the store lookup both read them (a re-plan after a preemption hashes nothing)
    prompt_keys: list[bytes] = field(default_factory=list)
    cache_salt: str = ""             # keys its blocks apart from other salts' (a tenant's prefixes are its own)
    chain_root: bytes | None = None  # where its key chain starts (hashing.salted_root); None: the namespace root
    cache_points: tuple[int, ...] = ()   # exact mode: prompt positions where a prefill chunk ends with a snapshot
    slot: int | None = None          # its KV pool slot (windows, compressor carry) while it has a state
    metrics: Metrics = field(default_factory=Metrics)
    arrival_seq: int = field(default_factory=lambda: next(_ids))
    parent: "Request | None" = None  # n > 1: children fork from the parent after its prefill
    text: str = ""                   # detokenised output (when a tokenizer is attached)
    text_cut: bool = False           # a stop string cut `text`: later decodes leave it as it is
    usage: object = None             # engine.cache.prefix_cache.CacheUsage when a cache is configured
    resume: object = None            # after a prefix hit: how its first state is built (cache.prefix_cache.Resume)
    cache_planned: bool = False      # the prefix cache has looked this request up
    saved_blocks: int = 0            # leading full blocks already saved to (or loaded from) the cache
    guide: object = None             # its constraint's state (engine.structured.guide.Guide), if it has one
    proposal: object = None          # speculative decoding: the drafts for its next step (speculative.drafters)

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"req-{self.arrival_seq}"
        self.metrics.prompt_tokens = len(self.prompt)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def sort_key(self) -> tuple[int, int, int]:
        return (self.priority, self.arrival_seq, self.stream)   # n > 1 samples share their parent's arrival


def checked_cache_points(points, prompt_len: int) -> tuple[int, ...]:
    """A request's cache points, sorted and once each, or a ValueError naming the first bad one."""
    try:
        points = list(points)
    except TypeError:
        raise ValueError(f"cache_points must be a sequence of prompt positions, got {type(points).__name__}") from None
    for p in points:
        if not isinstance(p, numbers.Integral) or isinstance(p, bool):
            raise ValueError(f"cache point {p!r} is not an integer position")
        if not 0 < p < prompt_len:
            raise ValueError(f"cache point {p} is outside the prompt (0 < point < {prompt_len})")
    return tuple(sorted({int(p) for p in points}))


def prompt_ids(prompt, tokenizer) -> list[int]:
    """A prompt's token ids: text through the tokenizer (with BOS), or the ids given."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids instead")
        return tokenizer.encode(prompt, add_bos=True)
    return [int(t) for t in prompt]


def check_request(ids: list[int], params: SamplingParams, mc, tokenizer) -> None:
    """A ValueError saying what is wrong with a request for a model with config `mc`."""
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < mc.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the model's vocabulary (0..{mc.vocab_size - 1})")
    if len(ids) + params.max_tokens > mc.max_position_embeddings:
        raise ValueError(f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} exceeds the model's "
                         f"context of {mc.max_position_embeddings} tokens")
    params.check_vocab(mc.vocab_size)
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
