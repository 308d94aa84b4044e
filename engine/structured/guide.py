"""One request's constraint as it decodes: its matcher, and whether the constraint has begun.

    thinking ─ tokens pass unchecked ─ </think> (think_end) ─┐   (after_thinking constraints)
                                                              v
    constrained ─ each committed token consumed ─ matcher stopped: the request is done (STOP)

Only committed tokens reach the matcher (a sampled token the request keeps), so after a
preemption, which keeps the request's output and recomputes its KV, the matcher is already where
the output is: nothing to replay. `rollback(n)` takes back the last n committed tokens, across
the thinking block's end too (speculative decoding's rejected drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.engine.structured.grammar import Matcher


@dataclass
class Guide:
    matcher: Matcher
    think_end: int | None = None      # the token that closes the thinking block (after_thinking), else None
    start: int | None = 0             # committed tokens before the constraint began; None: still thinking
    seen: int = 0                     # tokens committed in all

    @classmethod
    def for_request(cls, matcher: Matcher, think_end: int | None) -> Guide:
        return cls(matcher, think_end, None if think_end is not None else 0)

    @property
    def active(self) -> bool:
        return self.start is not None

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS could follow, so the request ends here."""
        return self.active and self.matcher.stopped

    def commit(self, token: int) -> str | None:
        """Advance by one kept token; the reason, when the grammar refuses it (the request fails)."""
        self.seen += 1
        if not self.active:
            if token == self.think_end:
                self.start = self.seen
            return None
        ok = self.matcher.consume(token)
        problem = self.matcher.error()      # a failed matcher still "consumes" EOS: never a quiet end
        if ok and not problem:
            return None
        return f"the output left its constraint at token {token}: {problem or 'not allowed'}"

    def accepts(self, token: int) -> bool:
        """Whether commit(token) would keep to the constraint (nothing changes)."""
        return not self.active or self.matcher.validate([token]) == 1

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self.seen:
            raise ValueError(f"cannot roll back {n} of {self.seen} committed tokens")
        after = self.seen - n
        if self.active:
            self.matcher.rollback(self.seen - max(after, self.start))
            if after < self.start:
                self.start = None
        self.seen = after

    def fork(self) -> Guide:
        return Guide(self.matcher.fork(), self.think_end, self.start, self.seen)
