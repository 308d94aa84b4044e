"""`kvcache bench structured`'s grammar costs alone (parts 2 and 3 of benchmarks/structured.py):

    compile_times   GrammarCompiler.matcher's first build of each schema, a fresh compiler per
                    pass with its cache off (cache_size 0), checked by its `compiled` count
    fill_times      GrammarCompiler.fill_batch of n rows, each a matcher walking its schema one
                    random allowed token per fill (Trajectories): mid-JSON states, never repeated
    apply_times     masks.apply of one such row to a logits vector of the compiler's width

run on any tokenizer.json text at any logit width; `wide_tokenizer_json` trains one of a real
tokenizer's size (a real DeepSeek tokenizer cannot be fetched here).
"""

from __future__ import annotations

import random
import time

import numpy as np


def percentiles(samples: list[float]) -> dict:
    p50, p99 = np.percentile(np.asarray(samples) * 1e3, [50, 99])
    return {"p50_ms": float(p50), "p99_ms": float(p99), "max_ms": max(samples) * 1e3, "samples": len(samples)}


def compile_times(tokenizer_json: str, width: int, eos: int, schemas, passes: int) -> dict:
    """Each schema's first matcher: a fresh compiler per pass, its cache off (cache_size 0)."""
    from kvcache.engine.structured.compiler import GrammarCompiler
    from kvcache.engine.structured.constraint import Constraint
    times = []
    for _ in range(passes):
        compiler = GrammarCompiler(tokenizer_json, width, eos, cache_size=0)
        for _, schema in schemas:
            t = time.perf_counter()
            compiler.matcher(Constraint.json(schema))
            times.append(time.perf_counter() - t)
        if compiler.compiled != len(schemas):
            raise AssertionError(f"{compiler.compiled} builds for {len(schemas)} schemas: a cached matcher was timed")
        compiler.close()
    return percentiles(times)


class Trajectories:
    """`rows` matchers walking their schemas one random allowed token per fill (EOS never taken),
    each replaced by a fresh one when its grammar completes: mid-JSON states, never the same twice."""

    def __init__(self, compiler, schemas, rows: int, seed: int):
        from kvcache.engine.structured import masks
        self.compiler, self.schemas, self.masks = compiler, schemas, masks
        self.rng = np.random.default_rng(seed)
        self.mask = masks.allocate(rows, compiler.vocab_size)
        self.matchers = [self._fresh(r) for r in range(rows)]
        for _ in range(16):                      # start apart, past the opening brace
            self.fill()
            self.advance(skip=0.3)

    def _fresh(self, row: int):
        from kvcache.engine.structured.constraint import Constraint
        return self.compiler.matcher(Constraint.json(self.schemas[int(self.rng.integers(len(self.schemas)))][1]))

    def fill(self) -> None:
        self.compiler.fill_batch([(m, r) for r, m in enumerate(self.matchers)], self.mask)

    def advance(self, skip: float = 0.0) -> None:
        for r, m in enumerate(self.matchers):
            if self.rng.random() < skip:
                continue
            ok = np.flatnonzero(self.masks.allowed(self.mask[r], self.compiler.vocab_size))
            ok = ok[ok != self.compiler.eos_id]
            if m.stopped or not len(ok) or not m.consume(int(self.rng.choice(ok))):
                self.matchers[r] = self._fresh(r)


def fill_times(compiler, schemas, rows: int, iters: int, seed: int) -> dict:
    walk = Trajectories(compiler, schemas, rows, seed)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        walk.fill()
        times.append(time.perf_counter() - t)
        walk.advance()
    return percentiles(times)


def apply_times(compiler, schemas, iters: int, seed: int) -> dict:
    """masks.apply of one mid-JSON row to a [width] logits vector (the sampler's host-side cost)."""
    import torch
    walk = Trajectories(compiler, schemas, 1, seed)
    logits, times = torch.zeros(compiler.vocab_size), []
    for _ in range(iters):
        walk.fill()
        logits.zero_()
        t = time.perf_counter()
        walk.masks.apply(logits, walk.mask[0])
        times.append(time.perf_counter() - t)
        walk.advance()
    return percentiles(times)


def grammar_costs(tokenizer_json: str, width: int, eos: int, schemas, rows: list[int], iters: int, passes: int,
                  seed: int) -> dict:
    from kvcache.engine.structured.compiler import GrammarCompiler
    compiler = GrammarCompiler(tokenizer_json, width, eos)
    try:
        return {"logit_width": width, "compile": compile_times(tokenizer_json, width, eos, schemas, passes),
                "fill_batch": {str(n): fill_times(compiler, schemas, n, iters, seed) for n in rows},
                "apply_row": apply_times(compiler, schemas, iters, seed)}
    finally:
        compiler.close()


def wide_tokenizer_json(vocab: int, seed: int = 0) -> str:
    """A byte-level BPE of `vocab` tokens with DeepSeek's special tokens, trained on a seeded text of
    pseudo-words, numbers and JSON: a vocabulary of a real tokenizer's size for the mask's cost (a
    real DeepSeek tokenizer cannot be fetched here; the demo one has a few hundred tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from kvcache.engine.tokenizer import SPECIAL_TOKENS
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ai", "ou", "ee")]
    words = ["".join(rng.choice(syllables) for _ in range(rng.choice((1, 2, 2, 3, 3, 4)))) for _ in range(2 * vocab)]

    def line() -> str:
        w = [words[min(int(rng.paretovariate(0.7)) - 1, len(words) - 1)] if rng.random() < 0.5 else rng.choice(words)
             for _ in range(12)]
        k = rng.random()
        if k < 0.3:
            return f'{{"{w[0]}": "{" ".join(w[1:5])}", "{w[5]}": {rng.randint(0, 99999)}}}'
        return " ".join(x.capitalize() for x in w[:6]) + f" {rng.random():.4f}" if k < 0.4 else " ".join(w) + "."
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator([line() for _ in range(max(2000, 6 * vocab))], trainer=trainer)
    return tok.to_str()


def vocab_size(tokenizer_json: str) -> int:
    from tokenizers import Tokenizer
    return Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
