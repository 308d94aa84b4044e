"""Constraints compiled to matchers with llguidance, against the checkpoint's own tokenizer.

    GrammarCompiler(tokenizer.json text, logit width, EOS id, tool-call dialect)
      grammar_text(constraint)   llguidance's grammar JSON: json_schema / regex / Lark (choice and
                                 tool calls are Lark written here and in tool_grammar.py)
      matcher(constraint)        a fresh Matcher: the first one per (constraint, tokenizer) is built
                                 and checked, then kept (an LRU of `cache_size`); each request gets a
                                 deep copy of it (cheap: the lexer built so far is shared)
      compile(constraint)        the same, awaited, in the compiler's worker pool (off the event
                                 loop; a compile past `timeout_s` is a GrammarError)
      fill_batch([(matcher, row)], mask)   a batch's masks in llguidance's parallel executor

The tokenizer is built once per compiler. Limits bound what one constraint may cost: its lexer's
states (about 1-2 kB each: `max_lexer_states` bounds a cache entry's memory; the copies of one
entry share its lexer, so the bound is for all of them together, and an entry whose copy fails
is forgotten, so the next request starts a fresh lexer), the fuel one mask may
burn, the grammar's size; a constraint past them is a GrammarError, as is one that fails to parse.
JSON is compact (no free whitespace: a random-weight or unsure model cannot pad forever).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import llguidance as llg
import llguidance.numpy as llg_np
import numpy as np

from kvcache.engine.structured.constraint import Constraint
from kvcache.engine.structured.grammar import GrammarError
from kvcache.engine.structured.tool_grammar import tool_call_lark

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def default_limits() -> "llg.LLParserLimits":
    return llg.LLParserLimits(max_lexer_states=50_000, max_grammar_size=200_000, initial_lexer_fuel=2_000_000,
                              step_lexer_fuel=400_000, step_max_items=100_000)


class LLGuidanceMatcher:
    """engine/structured/grammar.py's Matcher over an llguidance LLMatcher."""

    def __init__(self, inner: "llg.LLMatcher", executor: "llg.LLExecutor", on_error=None):
        """`on_error()` runs the first time error() finds the matcher failed: copies of one
        compiled matcher share its lexer, so a lexer limit reached by one holds for every later
        copy; the compiler then forgets that entry and the next request builds it afresh."""
        self.inner, self._executor, self._on_error = inner, executor, on_error

    def fill(self, mask: np.ndarray, row: int) -> None:
        llg_np.fill_next_token_bitmask(self.inner, mask, row)

    def fill_drafts(self, draft: list[int], mask: np.ndarray, row: int) -> None:
        llg_np.fill_next_token_bitmask_par_with_draft_tokens(self._executor, [(self.inner, row, list(draft))], mask)

    def validate(self, tokens: list[int]) -> int:
        return self.inner.validate_tokens(list(tokens))

    def consume(self, token: int) -> bool:
        return bool(self.inner.consume_token(int(token)))

    def rollback(self, n: int) -> None:
        if n and not self.inner.rollback(n):
            raise GrammarError(f"the grammar cannot roll back {n} tokens: {self.inner.get_error()}")

    def fork(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.inner.deep_copy(), self._executor, self._on_error)

    @property
    def stopped(self) -> bool:
        return self.inner.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.inner.is_accepting()

    def error(self) -> str:
        """"" or why it failed: the first line of llguidance's report (the rest dumps the grammar)."""
        if not self.inner.is_error():
            return ""
        if self._on_error is not None:
            self._on_error()
            self._on_error = None
        lines = self.inner.get_error().strip().splitlines()
        return _short(lines[0] if lines else "the matcher failed")


class GrammarCompiler:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_id: int, dialect: str = "v41",
                 cache_size: int = 256, workers: int = 2, timeout_s: float = 10.0, limits=None,
                 special_ids: dict[str, int] | None = None):
        """`vocab_size`: the model's logit width (masks are that wide; ids past the tokenizer are
        never allowed). `dialect`: the DSML tool-call spelling ("v4" | "v41"). `special_ids`: the
        tokenizer's ids of the markers a grammar names (tool_grammar.py)."""
        self.vocab_size, self.eos_id, self.dialect, self.timeout_s = vocab_size, eos_id, dialect, timeout_s
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_id)
        self.special_ids = dict(special_ids or {})
        self.limits = limits or default_limits()
        self.executor = llg.LLExecutor(max(1, workers))
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple, llg.LLMatcher] = OrderedDict()
        self._cache_size, self._lock = cache_size, threading.Lock()
        self.compiled = 0                   # matchers built (cache misses): for metrics and tests

    # ------------------------------------------------------------------ grammars
    def grammar_text(self, c: Constraint) -> str:
        try:
            if c.kind == "json":
                return llg.LLMatcher.grammar_from_json_schema(_schema(c.spec), defaults=JSON_DEFAULTS)
            if c.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(c.spec)
            if c.kind == "choice":
                return llg.LLMatcher.grammar_from_lark(choice_lark(json.loads(c.spec)))
            if c.kind == "grammar":
                return llg.LLMatcher.grammar_from_lark(c.spec)
            return llg.LLMatcher.grammar_from_lark(tool_call_lark(json.loads(c.spec), self.dialect, c.opened,
                                                                  self.special_ids))
        except GrammarError:
            raise
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"the {c.kind} constraint is invalid: {_short(e)}") from None

    def matcher(self, c: Constraint) -> LLGuidanceMatcher:
        """A fresh matcher for `c` (a GrammarError if it does not compile)."""
        with self._lock:
            base = self._cache.get(c.key)
            if base is not None:
                self._cache.move_to_end(c.key)
                return LLGuidanceMatcher(base.deep_copy(), self.executor, lambda: self.forget(c))
        base = self._build(c)                   # outside the lock: a slow compile blocks no other
        with self._lock:
            self._cache[c.key] = base
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return LLGuidanceMatcher(base.deep_copy(), self.executor, lambda: self.forget(c))

    def forget(self, c: Constraint) -> None:
        """Drop `c`'s compiled matcher (one of its copies failed: the shared lexer is spent)."""
        with self._lock:
            self._cache.pop(c.key, None)

    async def compile(self, c: Constraint) -> None:
        """Compile `c` off the event loop (the engine's later `matcher(c)` finds it cached)."""
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self.matcher, c)
        try:
            await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            raise GrammarError(f"the {c.kind} constraint took over {self.timeout_s:g} s to compile; "
                               "simplify it") from None

    def _build(self, c: Constraint) -> "llg.LLMatcher":
        text = self.grammar_text(c)
        problem = llg.LLMatcher.validate_grammar(text, self.tokenizer)
        if problem:
            raise GrammarError(f"the {c.kind} constraint is invalid: {_short(problem)}")
        m = llg.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
        if m.is_error():
            raise GrammarError(f"the {c.kind} constraint cannot be compiled: {_short(m.get_error())}")
        mask = np.zeros((1, (self.vocab_size + 31) // 32), dtype=np.int32)
        llg_np.fill_next_token_bitmask(m, mask, 0)      # the first mask builds the lexer: its limits bite here
        if m.is_error():
            raise GrammarError(f"the {c.kind} constraint exceeds the compiler's limits: {_short(m.get_error())}")
        if not mask.any():
            raise GrammarError(f"the {c.kind} constraint allows no output with this model's tokenizer")
        self.compiled += 1
        return m

    # ------------------------------------------------------------------ masks
    def fill_batch(self, rows: list[tuple[LLGuidanceMatcher, int]], mask: np.ndarray) -> None:
        """Fill each (matcher, row) of one step's batch, in parallel."""
        if rows:
            llg_np.fill_next_token_bitmask_par(self.executor, [(m.inner, r) for m, r in rows], mask)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def choice_lark(choices: list[str]) -> str:
    """`start: "a" | "b" ...`, each choice a JSON-escaped Lark literal."""
    if not choices or not all(isinstance(s, str) and s for s in choices):
        raise GrammarError("a choice constraint needs a non-empty list of non-empty strings")
    return "start: " + " | ".join(json.dumps(s, ensure_ascii=False) for s in choices) + "\n"


def _schema(spec: str):
    try:
        schema = json.loads(spec)
    except ValueError as e:
        raise GrammarError(f"the JSON schema is not JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object (or true/false)")
    return schema


def _short(e) -> str:
    text = str(e).strip()
    return text if len(text) <= 500 else text[:500] + "..."


THINK_END = "</think>"
MARKERS = ("｜DSML｜", "</｜DSML｜")


def engine_compiler(tokenizer, model_config) -> GrammarCompiler | None:
    """The compiler of an engine with this tokenizer (engine/tokenizer.py's) and model config;
    None without a tokenizer (token-id prompts: constraints are refused)."""
    if tokenizer is None:
        return None
    special = {m: tokenizer.token_id(m) for m in MARKERS if tokenizer.token_id(m) is not None}
    dialect = "v41" if model_config.model_type == "deepseek_v41" else "v4"
    eos = model_config.eos_token_id if model_config.eos_token_id is not None else tokenizer.eos_id
    return GrammarCompiler(tokenizer.backend.to_str(), model_config.vocab_size, eos, dialect, special_ids=special)
