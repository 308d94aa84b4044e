"""Token bitmasks: one int32 row of ceil(V/32) words per sampling row, applied to logits.

    bit t of row r  =  word (t >> 5), bit (t & 31), little-endian  ->  token t allowed
    apply:  logits[r, t] = -inf where the bit is clear (ids past the mask's width too)

The unpacking is numpy's `unpackbits` over the words' bytes (little bit order): one pass over
V/8 bytes, no compiled kernel to build, the same on every host. The mask is applied first, before
bias, penalties, temperature and top-k/p: those then work on the allowed tokens only.
"""

from __future__ import annotations

import numpy as np
import torch


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate(rows: int, vocab_size: int) -> np.ndarray:
    """A bitmask of `rows` rows, every token allowed."""
    return np.full((rows, words(vocab_size)), -1, dtype=np.int32)


def allowed(mask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """One row as a bool array of the vocabulary's width."""
    bits = np.unpackbits(np.ascontiguousarray(mask_row).view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def apply(logits: torch.Tensor, mask_row: np.ndarray) -> torch.Tensor:
    """`logits` [V] with the tokens the row forbids at -inf (in place; returned for chaining)."""
    ok = torch.from_numpy(allowed(mask_row, logits.shape[-1]))
    if ok.shape[0] < logits.shape[-1]:              # a mask narrower than the logits forbids the rest
        ok = torch.cat([ok, torch.zeros(logits.shape[-1] - ok.shape[0], dtype=torch.bool)])
    logits.masked_fill_(~ok.to(logits.device), float("-inf"))
    return logits


def count(mask_row: np.ndarray, vocab_size: int) -> int:
    return int(allowed(mask_row, vocab_size).sum())
