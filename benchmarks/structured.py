"""`kvcache bench structured` / `python -m kvcache.benchmarks.structured`: what a JSON-schema
constraint costs the engine's decode, and what its grammar work costs alone.

    1 decode A/B, per batch size b (one engine, a demo checkpoint, seeded sampling, temperature 1):

        each batch of b requests (each on its own schema), --repeats times:
          constrained ──> each request's generated count n_i
          free        ──> the same prompts and seeds, max_tokens = n_i, ignore_eos
                          (the same decode steps: only the masks differ)
        decode tok/s = sum of (n_i - 1) / (last finish - first token) of the batch
        ratio = the median pair's constrained / free (a pair runs seconds apart: drift cancels);
        also the fill's time (BatchMasks.fill_s) and the sampler's wait for it (was it hidden?)

    2 compile: GrammarCompiler.matcher's first build of each schema (a fresh compiler, no cache)
    3 fill: GrammarCompiler.fill_batch of 1 / 8 / 32 rows in mid-JSON states, each row advanced
      by one allowed token between fills; masks.apply of one row to a logits vector

Parts 2 and 3 run on the checkpoint's tokenizer at the model's width and on a 32768-token
byte-level BPE (trained here on a seeded synthetic text) at the real V4 width, 129280.
The JSON report (with the machine description) goes to OUT_DIR/structured-<time>.json and
structured-latest.json; structured_grammar.py times parts 2 and 3, structured_report.py assembles
and prints the report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

from kvcache.benchmarks import verbs
from kvcache.benchmarks.structured_grammar import grammar_costs, vocab_size, wide_tokenizer_json

# a few representative schemas of our own (flat, nested, enums, formats, arrays, $defs), used
# unless --schemas names a directory of *.json schemas
BUILTIN_SCHEMAS = {
    "user": {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
             "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                            "email": {"type": "string", "format": "email"},
                            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}},
    "weather_call": {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
                     "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 30},
                                    "unit": {"enum": ["celsius", "fahrenheit"]},
                                    "days": {"type": "integer", "minimum": 1, "maximum": 14}}},
    "event": {"type": "object", "required": ["title", "start", "attendees"], "additionalProperties": False,
              "properties": {"title": {"type": "string", "maxLength": 60},
                             "start": {"type": "string", "format": "date-time"},
                             "attendees": {"type": "array", "minItems": 1, "maxItems": 3,
                                           "items": {"$ref": "#/$defs/person"}}},
              "$defs": {"person": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"name": {"type": "string", "maxLength": 30},
                                                  "role": {"enum": ["host", "guest"]}}}}},
    "sentiment": {"type": "object", "required": ["label", "score"], "additionalProperties": False,
                  "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                 "score": {"type": "number", "minimum": 0, "maximum": 1}}},
    "order": {"type": "object", "required": ["id", "lines", "paid"], "additionalProperties": False,
              "properties": {"id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"}, "paid": {"type": "boolean"},
                             "lines": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
                                 "type": "object", "required": ["sku", "qty"], "additionalProperties": False,
                                 "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{3}$"},
                                                "qty": {"type": "integer", "minimum": 1}}}}}},
}


def load_schemas(directory: str | None) -> list[tuple[str, dict]]:
    """(name, schema) of every *.json in `directory`, by file name; the built-in ones without it."""
    if directory is None:
        return list(BUILTIN_SCHEMAS.items())
    out = []
    for f in sorted(os.listdir(directory)):
        if f.endswith(".json"):
            with open(os.path.join(directory, f), encoding="utf-8") as fh:
                out.append((f[:-5], json.load(fh)))
    if not out:
        raise ValueError(f"no *.json schemas in {directory}")
    return out


# ---------------------------------------------------------------- 1: decode, constrained vs free
class ApplyClock:
    """An engine's BatchMasks, instrumented: the sampler's time in StepMasks.apply (waiting for the
    step's fill, then masking the logits), and of it the wait alone: from the first masked row's
    apply until the fill finished (fill_batch returned), zero when it had finished already."""

    def __init__(self, inner):
        self.inner, self.apply_s, self.wait_s, self.rows, self.done_at = inner, 0.0, 0.0, 0, 0.0
        self._fill_batch, inner.compiler = inner.compiler.fill_batch, self      # fills come through here

    def fill_batch(self, rows, mask) -> None:
        self._fill_batch(rows, mask)
        self.done_at = time.perf_counter()

    @property
    def fill_s(self) -> float:
        return self.inner.fill_s

    def start(self, chunks):
        step = self.inner.start(chunks)
        return None if step is None else _TimedStep(step, self)

    def close(self) -> None:
        self.inner.close()


class _TimedStep:
    def __init__(self, step, clock: ApplyClock):
        self.step, self.clock, self.waited = step, clock, False

    def apply(self, row: int, logits):
        t = time.perf_counter()
        problem = self.step.apply(row, logits)          # waits for the fill at its first masked row
        now = time.perf_counter()
        self.clock.apply_s += now - t
        if row in self.step.rows:
            self.clock.rows += 1
            if not self.waited:
                self.waited, self.clock.wait_s = True, self.clock.wait_s + max(0.0, min(self.clock.done_at, now) - t)
        return problem


@dataclass
class Side:
    """One round of one side: its batches run to completion, one after another."""
    counts: list[int] = field(default_factory=list)       # tokens generated per request
    decode_tokens: int = 0                                 # generated after each request's first
    decode_s: float = 0.0                                  # per batch: last finish - first token
    step_s: list[float] = field(default_factory=list)      # decode steps (each batch's first is its prefill)
    all_steps_s: float = 0.0
    fill_s: float = 0.0                                    # BatchMasks.fill_s spent in this round
    apply_s: float = 0.0                                   # the sampler's time in StepMasks.apply (ApplyClock)
    wait_s: float = 0.0                                    # of it, waiting for the fill
    masked_rows: int = 0                                   # logits rows it masked
    finish: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / max(self.decode_s, 1e-9)


def run_side(engine, prompts: list[list[int]], params: list, batch: int) -> Side:
    """Submit `batch` requests at a time, each batch once the one before it has finished (the
    engine's masks an ApplyClock)."""
    side, clock = Side(), engine.masks
    before = (clock.fill_s, clock.apply_s, clock.wait_s, clock.rows)
    for at in range(0, len(prompts), batch):
        reqs = [engine.add_request(p, sp) for p, sp in zip(prompts[at:at + batch], params[at:at + batch])]
        steps = []
        while engine.has_work():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        started = [r.metrics.first_token for r in reqs if r.metrics.first_token is not None]
        side.decode_s += max(r.metrics.finished for r in reqs) - min(started)
        side.decode_tokens += sum(max(len(r.output) - 1, 0) for r in reqs)
        side.step_s += steps[1:]
        side.all_steps_s += sum(steps)
        for r in reqs:
            side.counts.append(len(r.output))
            reason = r.finish_reason.value if r.finish_reason else "none"
            side.finish[reason] = side.finish.get(reason, 0) + 1
            engine.forget(r.request_id)
    side.fill_s, side.apply_s, side.wait_s, side.masked_rows = (
        now - then for now, then in zip((clock.fill_s, clock.apply_s, clock.wait_s, clock.rows), before))
    return side


def decode_requests(tokenizer, schemas: list[tuple[str, dict]], n: int) -> list[tuple[str, dict, list[int]]]:
    """`n` requests over schemas spread evenly through the list: (name, schema, prompt ids)."""
    picks = [schemas[i * len(schemas) // n] if n <= len(schemas) else schemas[i % len(schemas)] for i in range(n)]
    return [(name, s, tokenizer.encode(f"Reply with one JSON value for the schema {name!r}.\n")) for name, s in picks]


def decode_ab(engine, requests, batch: int, repeats: int, max_tokens: int, seed: int, bar=None) -> dict:
    """`repeats` times, each batch of `batch` requests constrained then free: pairs a few seconds
    apart, so that the machine's drift between them stays small."""
    from kvcache.benchmarks.structured_report import summarize_ab
    from kvcache.engine.sampling import SamplingParams
    from kvcache.engine.structured.constraint import Constraint
    prompts = [p for _, _, p in requests]
    seeds = [seed * 1000 + i for i in range(len(requests))]
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, constraint=Constraint.json(schema))
                   for (_, schema, _), s in zip(requests, seeds)]
    # untimed: the first steps of a batch shape, and the grammars' first lexer states
    run_side(engine, prompts[:batch], [SamplingParams(max_tokens=4, temperature=1.0, seed=0, ignore_eos=True,
                                                      constraint=c.constraint) for c in constrained[:batch]], batch)
    pairs = []
    for _ in range(repeats):
        for at in range(0, len(requests), batch):
            group = slice(at, at + batch)
            c = run_side(engine, prompts[group], constrained[group], batch)
            free = [SamplingParams(max_tokens=max(n, 1), temperature=1.0, seed=s, ignore_eos=True)
                    for n, s in zip(c.counts, seeds[group])]
            pairs.append((c, run_side(engine, prompts[group], free, batch)))
        if bar is not None:
            bar.update(1)
    out = summarize_ab(pairs)
    out["generated_tokens"] = [n for c, _ in pairs[:len(pairs) // repeats] for n in c.counts]
    return out


# ---------------------------------------------------------------- the run
@dataclass(frozen=True)
class Settings:
    config: str = "v41-small"
    batches: tuple[int, ...] = (1, 8)
    requests: int = 8
    repeats: int = 5
    max_tokens: int = 48
    schemas: str | None = None
    fill_rows: tuple[int, ...] = (1, 8, 32)
    fill_iters: int = 200
    compile_passes: int = 3
    wide_vocab: int = 32768
    wide_width: int = 129280
    compile: bool = False
    seed: int = 0


def run(s: Settings, out_dir: str, models_dir: str | None = None, progress: bool = True) -> dict:
    import torch
    from tqdm import tqdm
    from kvcache.benchmarks.record import load_now, machine_info, write_results
    from kvcache.benchmarks.structured_report import document
    from kvcache.engine.checkpoint.demo import demo_checkpoint
    from kvcache.engine.config import EngineConfig
    from kvcache.engine.llm import LLM
    os.makedirs(out_dir, exist_ok=True)
    schemas, started, load_at_start = load_schemas(s.schemas), time.perf_counter(), load_now()
    scratch = None if models_dir else tempfile.mkdtemp(prefix=".kvcache-bench-structured-",
                                                       dir=os.path.abspath(out_dir))
    try:
        t = time.perf_counter()
        checkpoint = demo_checkpoint(models_dir or scratch, s.config)
        cfg = EngineConfig(block_size=16, num_blocks=max(64, max(s.batches) * (64 + s.max_tokens) // 16 + 16),
                           max_tokens_per_step=max(512, 64 * max(s.batches)), max_running=max(s.batches),
                           compile=s.compile)
        llm = LLM(checkpoint, config=cfg)
        setup_s = time.perf_counter() - t
        engine = llm.engine
        engine.masks = ApplyClock(engine.masks)
        requests = decode_requests(engine.tokenizer, schemas, s.requests)
        with tqdm(total=len(s.batches) * s.repeats + 2, desc="structured benchmark", unit="round",
                  disable=not progress) as bar:
            decode = {f"b{b}": decode_ab(engine, requests, b, s.repeats, s.max_tokens, s.seed, bar) for b in s.batches}
            grammar = {"engine": grammar_costs(engine.tokenizer.backend.to_str(), engine.model.config.vocab_size,
                                               engine.grammars.eos_id, schemas, list(s.fill_rows), s.fill_iters,
                                               s.compile_passes, s.seed)}
            bar.update(1)
            wide = wide_tokenizer_json(s.wide_vocab, s.seed)
            grammar["wide"] = grammar_costs(wide, s.wide_width, 1, schemas, list(s.fill_rows), s.fill_iters,
                                            s.compile_passes, s.seed)
            bar.update(1)
        grammar["engine"]["tokenizer_vocab"] = engine.tokenizer.vocab_size
        grammar["wide"]["tokenizer_vocab"] = vocab_size(wide)
        llm.close()
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    doc = document(s, schemas, [name for name, _, _ in requests], decode, grammar, setup_s)
    doc["elapsed_s"] = time.perf_counter() - started
    doc["machine"] = {**machine_info(out_dir), "load_at_start": load_at_start, "torch": torch.__version__,
                      "torch_threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    write_results(doc, out_dir, "structured")
    return doc


# ---------------------------------------------------------------- CLI
def run_args(args: argparse.Namespace) -> int:
    from kvcache.benchmarks.structured_report import format_table
    s = Settings(args.config, tuple(args.batches), args.requests, args.repeats, args.max_tokens, args.schemas,
                 tuple(args.fill_rows), args.fill_iters, args.compile_passes, args.wide_vocab, args.wide_width,
                 args.compile, args.seed)
    doc = run(s, args.out_dir, args.models_dir, progress=not args.no_progress)
    print(format_table(doc))
    print(f"\nwrote {doc['files']['json']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return verbs.main("structured", argv)


if __name__ == "__main__":
    sys.exit(main())
