"""Terminal formatting shared by the CLI's commands."""

from __future__ import annotations

import sys
import time


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_table(rows, indent: int = 0) -> None:
    """Two aligned columns: label, value."""
    width = max(len(str(k)) for k, _ in rows)
    for k, v in rows:
        print(f"{' ' * indent}{str(k):<{width}}  {v}".rstrip())


def escape_controls(text: str) -> str:
    """`text` with each non-printable character written as repr() writes it (\\x1b, \\u200b, ...),
    so model output cannot move the cursor or recolour a terminal; letters of any script,
    spaces, newlines and tabs stay as they are."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


class LineProgress:
    """Progress for a stderr that is not a terminal (a log file, CI): a line at the start, then
    one every `every_s` seconds and one at the end, where tqdm would redraw one line with
    carriage returns. Used as tqdm is: `with LineProgress(...) as bar: bar.update(1)`."""

    def __init__(self, total: int, desc: str, unit: str, every_s: float = 10.0, file=None, clock=time.monotonic):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.file, self.clock = file if file is not None else sys.stderr, clock
        self.n, self._last_n = 0, -1
        self._start = self._last = clock()

    def __enter__(self) -> "LineProgress":
        self._line()
        return self

    def __exit__(self, *exc) -> None:
        if self._last_n != self.n:
            self._line()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self._last >= self.every_s:
            self._line()

    def _line(self) -> None:
        self._last, self._last_n = self.clock(), self.n
        elapsed = self._last - self._start
        left = f", ~{elapsed * (self.total - self.n) / self.n:.0f} s left" if 0 < self.n < self.total else ""
        pct = f" ({self.n / self.total:.0%})" if self.total else ""
        print(f"{self.desc}: {self.n:,}/{self.total:,} {self.unit}{pct}, {elapsed:.0f} s{left}",
              file=self.file, flush=True)
