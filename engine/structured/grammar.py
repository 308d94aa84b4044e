"""The grammar seam: what the engine asks of a compiled constraint, whatever library backs it.

A Matcher is one request's position in its grammar. The engine keeps it true to the request's
committed tokens (never a draft, never a token a stop cut): a token is consumed once sampled
and kept, `rollback(n)` takes back the last n consumed (a speculative step's rejected drafts).

    fill(mask, row)              row `row` of the int32 bitmask [rows, ceil(V/32)]: bit t set
                                 <=> token t may come next (EOS only where the grammar may end)
    fill_drafts(draft, mask, row) rows row..row+k: the masks after 0..k of the draft's tokens,
                                 the matcher's state unchanged (speculative decoding's k draft
                                 positions in one call); rows past an invalid draft token allow nothing
    validate(tokens) -> int      how many leading tokens the grammar accepts (state unchanged)
    consume(token) -> bool       advance; False: the token is not allowed (error() says why)
    rollback(n)                  undo the last n consumed tokens
    fork()                       an independent copy (n > 1 samples)
    stopped                      the grammar is complete: nothing but EOS may follow
    error()                      "" or why the matcher failed (it then allows nothing)

Masks of a whole batch are filled by the GrammarCompiler (`fill_batch`), in parallel native
threads that release the GIL, so the fill runs while the forward pass does.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class GrammarError(ValueError):
    """A constraint that cannot be compiled (a bad schema, pattern or grammar, or one past the
    compiler's limits): the client's mistake, its message says what to fix."""


class Matcher(Protocol):
    def fill(self, mask: np.ndarray, row: int) -> None: ...
    def fill_drafts(self, draft: list[int], mask: np.ndarray, row: int) -> None: ...
    def validate(self, tokens: list[int]) -> int: ...
    def consume(self, token: int) -> bool: ...
    def rollback(self, n: int) -> None: ...
    def fork(self) -> "Matcher": ...
    @property
    def stopped(self) -> bool: ...
    def error(self) -> str: ...
