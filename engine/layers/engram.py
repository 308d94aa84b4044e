"""Engram (V4.1 layers 1 and 14): n-gram memory added to every residual stream before the layer.

    token id ─ token_map ─> compressed id (normalised spelling: NFKC, NFD, strip accents, lower,
                            collapse whitespace; ids in order of first appearance)
    for the n-grams ending at p (n = 2 .. max_ngram_size), per head h:
        r_s = XOR_{i<=s} value(p - i) * mult[layer, i]        value: compressed id; once a position is
                                                               before the prompt or an image token, it and
                                                               every older one is the pad id
        row = (r_{n-1} mod prime[n, h]) + offset[n, h]        one table, sub-tables per (n, h)
    e = concat of the (max_ngram - 1) * n_heads rows [.., rows * head_dim]
    wkv(e) -> one key per stream + a shared value          [(hc + 1) * d]
    g_k = sigmoid(signed_sqrt(<rms(h_k) q_w[k], rms(key_k) k_w[k]> / sqrt(d)));   h_k += g_k * value

Multipliers: numpy default_rng(10007 * layer id), odd, below (int64 max // compressed vocab) / 2.
Primes: from engram_vocab_size - 1 upward, each the next prime not used by any (layer, n, head).
Image tokens get no Engram (g = 0) and break the n-grams behind them.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np
import torch
from torch import nn

from kvcache.engine.model_config import ModelConfig
from kvcache.engine.layers.norm import rms

DEAD = -1
SIGMOID_1E3 = float(torch.sigmoid(torch.tensor(1e-3, device="cpu")))   # the gate where q . k is exactly 0


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (bases 2, 7, 61: exact below 4.7e9)."""
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 61):
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in (2, 7, 61):
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def hash_geometry(config: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(multipliers [L, max_ngram], primes [L, (max_ngram-1) * heads], offsets [same]) for the engram layers."""
    layers, n_max, heads = config.engram_layer_ids, config.engram_max_ngram_size, config.engram_n_heads
    bound = max(1, (np.iinfo(np.int64).max // max(config.engram_compressed_vocab_size, 1)) // 2)
    mults = np.stack([np.random.default_rng(10007 * layer).integers(0, bound, size=n_max, dtype=np.int64) * 2 + 1
                      for layer in layers])
    used: set[int] = set()
    primes = []
    for _ in layers:
        row = []
        for _ in range(n_max - 1):
            cur = config.engram_vocab_size - 1
            for _ in range(heads):
                cur += 1
                while not _is_prime(cur) or cur in used:
                    cur += 1
                used.add(cur)
                row.append(cur)
        primes.append(row)
    primes_arr = np.array(primes, dtype=np.int64)
    offsets = np.concatenate([np.zeros((len(layers), 1), np.int64), np.cumsum(primes_arr, 1)[:, :-1]], 1)
    return mults, primes_arr, offsets


def normalise(text: str) -> str:
    """NFKC, NFD, strip accents, lowercase, collapse [ \t\r\n]+ to one space, strip; a token that
    is only whitespace stays one space."""
    t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    t = re.sub(r"[ \t\r\n]+", " ", "".join(ch for ch in t if not unicodedata.combining(ch)).lower())
    return " " if t == " " else t.strip()


def compressed_token_map(tokenizer) -> np.ndarray:
    """token id -> compressed id, by normalised spelling, in order of first appearance."""
    backend = tokenizer.backend
    n = backend.get_vocab_size(with_added_tokens=True)
    seen: dict[str, int] = {}
    out = np.zeros(n, dtype=np.int64)
    for i in range(n):
        text = backend.decode([i], skip_special_tokens=False)
        key = backend.id_to_token(i) if "\ufffd" in text else (normalise(text) or text)
        out[i] = seen.setdefault(key, len(seen))
    return out


class Engram(nn.Module):
    """`layers.{L}.engram.{embed.weight, wkv.weight, q_weight, k_weight}`."""

    def __init__(self, config: ModelConfig, slot: int):
        super().__init__()
        c = config
        self.slot, self.n_max, self.heads, self.eps = slot, c.engram_max_ngram_size, c.engram_n_heads, c.rms_norm_eps
        self.hc, d = c.hc_mult, c.hidden_size
        cols = (self.n_max - 1) * self.heads
        self.embed = nn.Embedding(c.engram_num_embeddings[slot], c.engram_head_dim)
        self.wkv = nn.Linear(cols * c.engram_head_dim, (self.hc + 1) * d, bias=False)
        self.q_weight = nn.Parameter(torch.ones(self.hc, d))
        self.k_weight = nn.Parameter(torch.ones(self.hc, d))

    def rows(self, values: torch.Tensor, mults: torch.Tensor, primes: torch.Tensor,
             offsets: torch.Tensor) -> torch.Tensor:
        """values [B, T, n_max] (compressed ids of p, p-1, ...; pads already in) -> table rows [B, T, cols]."""
        r = torch.zeros(values.shape[:2], dtype=torch.int64, device=values.device)
        cols = []
        for s in range(self.n_max):
            r = r ^ (values[..., s] * mults[s])
            if s >= 1:
                cols.append(torch.remainder(r[..., None], primes[(s - 1) * self.heads: s * self.heads]))
        return torch.cat(cols, -1) + offsets

    def forward(self, streams: torch.Tensor, rows: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """streams [B, T, hc, d] += gated value; rows [B, T, cols]; alive [B, T] (False: image token)."""
        e = self.embed(rows).flatten(-2)                                        # [B, T, cols * head_dim]
        kv = self.wkv(e).float().unflatten(-1, (self.hc + 1, -1))              # [B, T, hc + 1, d]
        keys, value = kv[..., : self.hc, :], kv[..., self.hc, :]
        d = streams.shape[-1]
        dot = (rms(streams, self.eps) * self.q_weight.float() * rms(keys, self.eps) * self.k_weight.float()).sum(-1)
        dot = dot / d ** 0.5
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
        gate = torch.where(dot == 0, torch.full_like(gate, SIGMOID_1E3), gate)
        gate = gate * alive[..., None].float()
        return (streams.float() + gate[..., None] * value[..., None, :]).to(streams.dtype)
