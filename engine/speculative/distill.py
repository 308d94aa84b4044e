"""Distillation of a checkpoint's drafter on its own target (`kvcache model distill`).

A demo checkpoint's weights are random, its drafter's too: drafts are then almost never
accepted, and acceptance rates in tests and benchmarks would mean nothing. Training the drafter
on the target's own outputs, on the CPU in minutes, gives a drafter that predicts its target as a
trained one would (it learns the target's next-token function, not language):

    data      prompts of random ids, continued by the target (greedy, and sampled at T = 0.8);
              one forward over each whole sequence gives the target's distribution p_t at every
              position and the streams the drafter reads (drafters.collect)
    MTP       position t: (streams at t, token t+1) -> token t+2; and chained once more on its
              own output streams -> token t+3 (as propose() chains it); loss KL(p_target || q)
    DSpark    anchor P (random per step): context = the target layers' streams at P-W+1 .. P-1,
              the draft block at P .. P+size-1 with the Markov head fed the true previous
              tokens; loss per position i, weighted exp(-i / size): KL(p_target || q_i) +
              BCE(confidence_i, 1 - TV(q_i, p_target)) (the confidence learns the survival)
    only the drafter's own parameters train (mtp.*); embedding and head stay the target's
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache.engine.models import dspark
from kvcache.engine.speculative.drafters import MTPDrafter, make_drafter


@dataclass
class Sequences:
    tokens: torch.Tensor            # [S, T] prompt + continuation
    probs: torch.Tensor             # [S, T, V] the target's distribution after each position (fp32)
    taps: dict                      # {layer: [S, T, hc, d]} the streams the drafter reads


@dataclass(frozen=True)
class DistillReport:
    corpus: Corpus
    method: str
    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    agreement: float                 # drafter argmax == target argmax at draft position 1, trained sequences
    held_out_agreement: float        # the same on sequences it never saw (a random target is a hash: ~0)


@dataclass(frozen=True)
class Corpus:
    """What the drafter is trained on: `n` random prompts (even ones continued greedily, odd ones
    sampled), a function of these numbers alone (the benchmark regenerates the prompts)."""
    n: int = 24
    prompt_len: int = 12
    gen_len: int = 52
    seed: int = 0
    id_range: int = 2000

    def prompts(self, vocab_size: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed)
        hi = min(self.id_range, vocab_size)
        return [torch.randint(3, hi, (self.prompt_len,), generator=g).tolist() for _ in range(self.n)]


@torch.no_grad()
def teacher_data(model, collect, corpus: Corpus = Corpus()) -> Sequences:
    """The corpus's prompts continued by the target (even: greedy, odd: at T = 0.8)."""
    g = torch.Generator().manual_seed(corpus.seed + 7)
    seqs = corpus.prompts(model.config.vocab_size)
    n, gen_len = corpus.n, corpus.gen_len
    states = [model.new_state() for _ in range(n)]
    chunks = [torch.tensor(s) for s in seqs]
    for _ in range(gen_len):
        logits = model.step(chunks, states)
        nxt = []
        for i, row in enumerate(logits):
            if i % 2 == 0:
                nxt.append(int(row.argmax()))
            else:
                nxt.append(int(torch.multinomial(torch.softmax(row.float() / 0.8, -1), 1, generator=g)))
        for s, t in zip(seqs, nxt):
            s.append(t)
        chunks = [torch.tensor([t]) for t in nxt]
    tokens = torch.tensor(seqs)
    probs, taps = [], {k: [] for k in collect}
    for s in seqs:
        logits, tap = model.step_rows([torch.tensor(s)], [model.new_state()], [len(s)], collect)
        probs.append(torch.softmax(logits.float(), -1))
        for k in collect:
            taps[k].append(tap[k][0].float())
    return Sequences(tokens, torch.stack(probs), {k: torch.stack(v) for k, v in taps.items()})


def _kl(p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p || softmax(logits)) per row, summed over the vocabulary."""
    logq = F.log_softmax(logits.float(), -1)
    return (p * (torch.log(p.clamp_min(1e-12)) - logq)).sum(-1)


def _mtp(model, streams, ids, positions):
    """The drafter's own MTP layer over one whole sequence, from an empty window: (streams, logits [T, V])."""
    return MTPDrafter(model)._layer(streams, ids, [positions], [model.mtp[0].attn.new_state()])


def mtp_loss(model, data: Sequences, rows: list[int], collect) -> torch.Tensor:
    losses = []
    for r in rows:
        tok, p, streams = data.tokens[r], data.probs[r], data.taps[collect[0]][r][None]
        T = tok.shape[0]
        pos = torch.arange(T - 2)
        h, logits = _mtp(model, streams[:, : T - 2], tok[None, 1: T - 1], pos)          # -> token t+2
        loss = _kl(p[1: T - 1], logits).mean()
        h2, logits2 = _mtp(model, h[:, : T - 3], tok[None, 2: T - 1], pos[: T - 3] + 1)   # chained -> t+3
        losses.append(loss + 0.5 * _kl(p[2: T - 1], logits2).mean())
    return torch.stack(losses).mean()


def dspark_loss(model, data: Sequences, rows: list[int], anchor: int) -> torch.Tensor:
    c = model.config
    size, W = int(c.extra["dspark_block_size"]), c.sliding_window
    idx = torch.tensor(rows)
    lo = max(0, anchor - (W - 1))
    taps = {k: v[idx, lo: anchor] for k, v in data.taps.items()}
    states = [stage.attn.new_state() for stage in model.mtp]
    dspark.write_context(model, taps, torch.arange(lo, anchor), states)
    toks, p = data.tokens[idx], data.probs[idx]
    hidden = dspark.draft_hidden(model, toks[:, anchor], anchor, states)               # [B, size, d]
    total = 0.0
    for i in range(size):
        logits, conf = dspark.heads(model, hidden[:, i], toks[:, anchor + i])
        target = p[:, anchor + i]
        q = torch.softmax(logits.float(), -1)
        survive = (1 - 0.5 * (q - target).abs().sum(-1)).detach().clamp(0, 1)
        w = math.exp(-i / size)
        total = total + w * (_kl(target, logits).mean() + F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), survive))
    return total


@torch.no_grad()
def agreement(model, data: Sequences, method: str, collect) -> float:
    """How often the drafter's first draft is the target's argmax, over the sequences given."""
    hits = total = 0
    if method == "mtp":
        for r in range(data.tokens.shape[0]):
            tok, p = data.tokens[r], data.probs[r]
            T = tok.shape[0]
            _, logits = _mtp(model, data.taps[collect[0]][r][None, : T - 2], tok[None, 1: T - 1], torch.arange(T - 2))
            hits += int((logits.argmax(-1) == p[1: T - 1].argmax(-1)).sum())
            total += T - 2
        return hits / total
    size = int(model.config.extra["dspark_block_size"])
    T = data.tokens.shape[1]
    for anchor in range(4, T - size - 1, 3):
        rows = list(range(data.tokens.shape[0]))
        states = [stage.attn.new_state() for stage in model.mtp]
        lo = max(0, anchor - (model.config.sliding_window - 1))
        dspark.write_context(model, {k: v[:, lo: anchor] for k, v in data.taps.items()}, torch.arange(lo, anchor),
                             states)
        hidden = dspark.draft_hidden(model, data.tokens[rows, anchor], anchor, states)
        logits, _ = dspark.heads(model, hidden[:, 0], data.tokens[rows, anchor])
        hits += int((logits.argmax(-1) == data.probs[rows, anchor].argmax(-1)).sum())
        total += len(rows)
    return hits / max(total, 1)


def distill(model, method: str, seconds: float = 120.0, max_steps: int = 100_000, lr: float = 2e-3,
            corpus: Corpus = Corpus(), progress=None) -> DistillReport:
    """Train `model`'s drafter (in place) for about `seconds` on its target's own outputs."""
    drafter = make_drafter(model, method)
    data = teacher_data(model, drafter.collect, corpus)
    seed = corpus.seed
    n = data.tokens.shape[0]
    held = list(range(n - 4, n))                      # agreement is measured on sequences never trained on
    train = list(range(n - 4))
    params = [p for p in model.mtp.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    size = int(model.config.extra.get("dspark_block_size", 1))
    T = data.tokens.shape[1]
    t0, first, last, step = time.perf_counter(), None, None, 0
    model.train(False)
    while step < max_steps and time.perf_counter() - t0 < seconds:
        rows = [train[int(i)] for i in torch.randint(len(train), (4 if method == "mtp" else 8,), generator=g)]
        if method == "mtp":
            loss = mtp_loss(model, data, rows, drafter.collect)
        else:
            anchor = int(torch.randint(4, T - size - 1, (1,), generator=g))     # context: up to W-1 before it
            loss = dspark_loss(model, data, rows, anchor)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        value = float(loss.detach())
        first = value if first is None else first
        last = value if last is None else 0.9 * last + 0.1 * value
        step += 1
        if progress is not None:
            progress(step, value)
    for p in params:
        p.requires_grad_(False)
    return DistillReport(corpus, method, step, time.perf_counter() - t0, first or 0.0, last or 0.0,
                         agreement(model, _rows(data, train[:8]), method, drafter.collect),
                         agreement(model, _rows(data, held), method, drafter.collect))


def _rows(data: Sequences, rows: list[int]) -> Sequences:
    return Sequences(data.tokens[rows], data.probs[rows], {k: v[rows] for k, v in data.taps.items()})


def distill_checkpoint(path: str, seconds: float, method: str | None = None, out: str | None = None,
                       corpus: Corpus = Corpus(), progress=None, max_steps: int | None = None) -> DistillReport:
    """Distill the drafter of the checkpoint at `path` and write the checkpoint back (to `out`, or
    in place: written beside it, then swapped in, so a crash leaves the old one), with
    `distill.json` saying what was trained on and how well it agrees."""
    import dataclasses
    import json
    import os
    import shutil
    from kvcache.engine.checkpoint.loader import load_model
    from kvcache.engine.checkpoint.writer import save_checkpoint, snap_to_formats
    model, config = load_model(path, progress=False)
    method = method or ("dspark" if "dspark_block_size" in config.extra else "mtp")
    report = distill(model.eval(), method, seconds, max_steps=max_steps or 100_000, corpus=corpus, progress=progress)
    snap_to_formats(model, config)
    target = out or path
    tmp = target.rstrip("/") + ".distilling"
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(model, config, tmp)
    for name in os.listdir(path):                   # the tokenizer and anything else beside the weights
        if not (name.endswith(".safetensors") or name.endswith(".index.json") or name == "config.json"):
            src = os.path.join(path, name)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(tmp, name))
    earlier = 0.0                                   # a checkpoint distilled before trains on from there
    if os.path.exists(os.path.join(path, "distill.json")):
        with open(os.path.join(path, "distill.json")) as f:
            earlier = float(json.load(f).get("total_seconds", 0.0))
    with open(os.path.join(tmp, "distill.json"), "w") as f:
        json.dump({**dataclasses.asdict(report), "total_seconds": earlier + report.seconds,
                   "source": os.path.abspath(path)}, f, indent=2)
    if os.path.exists(target):
        old = target.rstrip("/") + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old)
    else:
        os.rename(tmp, target)
    return report
