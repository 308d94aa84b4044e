"""Terminal formatting shared by the CLI's commands."""

from __future__ import annotations


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
