"""`kvcache report`: hit rates, tiers, tenants and prompt lengths from the event log.

    event files (kvstore/event_log.py) ──read_events──> pyarrow Table
        ──compute_report──> a plain dict (what --json prints, what the HTML is drawn from)
        ──> terminal summary, and with --out an HTML page with embedded PNG plots (report_html.py)

Hit rates are computed from `lookup` events, the engine's question "how much of this prompt
is cached?": a lookup's requested tokens are its prompt length in full blocks, its hit tokens
what the store holds. Prefill tokens saved are what readers used: the blocks `get` events
served (an engine fetches only the blocks it will use; a lookup's hit can be longer than that:
a tier slower than recomputing, a hit no longer than the replay window, an exact-mode hit cut
back to its last snapshot; in exact mode the tail snapshot read with a hit counts as one
block). Events are read from closed files and from the live files of a running daemon
(kvstore/event_log.py), so a report sees events a few seconds old. A lookup that misses entirely carries no namespace
unless the caller named it (`lookup(keys, namespace_id=...)`, which the engine does),
hence no block size and no token count (see `BlockStore._event`); its block size is taken
from the same tenant's other events (most frequent value), else from all events. If no event
has a block size at all, the report counts blocks instead of tokens and says so.
Odd values (NaN, negative counts, hits above requests, unknown kinds) are clipped or ignored
rather than allowed to crash a report.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import sys
import time

import numpy as np

from kvcache.cli.fmt import human_size, print_table
from kvcache.kvstore.types import STORE_TIERS

TIERS = STORE_TIERS          # the store's tiers, fastest first, as events name them
PREFIX_BUCKETS = ((1 << 10, "<1k"), (4 << 10, "1-4k"), (16 << 10, "4-16k"), (64 << 10, "16-64k"), (math.inf, ">=64k"))
AGE_BUCKETS = ((3600, "<1h"), (6 * 3600, "1-6h"), (86400, "6-24h"), (3 * 86400, "1-3d"), (math.inf, ">=3d"))
_TIME_STEPS = (60, 300, 900, 3600, 3 * 3600, 6 * 3600, 86400, 7 * 86400)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_STRINGS = ("kind", "tenant", "tier", "client")
_NUMERIC = ("time", "blocks", "tokens", "hit_blocks", "hits_dram", "hits_nvme", "hits_object", "nbytes",
            "latency_s", "mean_age_s")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="hit-rate report from the event log",
        description="Summarise the event log that `kvcache serve` keeps in DATA_DIR/events: token hit rate\n"
                    "overall, per tier, per tenant and per prompt length; prefill tokens saved; bytes per\n"
                    "tier; evictions and expirations by age. With --out, also an HTML page with plots.",
        epilog="examples:\n  kvcache report\n  kvcache report /data/kvcache --since 24h --out report.html\n"
               "  kvcache report /data/kvcache/events --since 2026-11-30T08:00Z --json")
    p.add_argument("data_dir", metavar="DIR", nargs="?",
                   help="a data directory or its events/ folder (default: the daemon's data directory)")
    p.add_argument("--since", metavar="24h|ISO",
                   help="only events this recent (30m, 24h, 7d, 2w) or after an ISO time (UTC unless it has an offset)")
    p.add_argument("--out", metavar="report.html", help="also write an HTML report with plots")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from kvcache.kvstore.event_log import event_files, live_files, read_events
    directory = resolve_events_dir(args.data_dir)
    since = parse_since(args.since, time.time()) if args.since else None
    table = read_events(directory, since, progress=not args.json and sys.stderr.isatty())
    rep = compute_report(table)
    rep.update(source=directory, files=len(event_files(directory)) + len(live_files(directory)), since=since)
    if args.out:
        from kvcache.cli.report_html import write_html
        write_html(rep, args.out)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_summary(rep, args.out)
    return 0


def resolve_events_dir(path: str | None) -> str:
    """DIR may be the data directory (its events/ folder is used) or the events folder itself."""
    if not path:
        from kvcache.server.config import default_data_dir
        path = default_data_dir()
    path = os.path.expanduser(path)
    if os.path.isdir(os.path.join(path, "events")):
        return os.path.join(path, "events")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"directory {path} does not exist")
    return path


def parse_since(text: str, now: float) -> float:
    """`24h`-style durations count back from `now`; anything else must be an ISO 8601 time."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhdw])", text.strip().lower())
    if m:
        return now - float(m[1]) * _UNITS[m[2]]
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: expected a duration (30m, 24h, 7d, 2w) "
                         "or an ISO time (2026-11-30T08:00Z)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when.timestamp()


# -------------------------------------------------------------------- numbers
def compute_report(table) -> dict:
    """Everything the terminal summary, the JSON and the plots show, from one Table of events."""
    c = _columns(table)
    rep: dict = {"events": int(len(c["time"]))}
    if not rep["events"]:
        return rep
    bs, known = _block_sizes(c)
    rep.update(first_time=float(c["time"].min()), last_time=float(c["time"].max()),
               unit="tokens" if known else "blocks", kinds=_kind_counts(c["kind"]))
    lk = c["kind"] == "lookup"
    req = c["blocks"][lk] * bs[lk]
    hit = np.minimum(c["hit_blocks"][lk], c["blocks"][lk]) * bs[lk]
    rep["lookups"] = {"count": int(lk.sum()), **_rate(req.sum(), hit.sum()),
                      "inferred_block_size": int((lk & (c["tokens"] <= 0) & (c["blocks"] > 0)).sum())}
    g = c["kind"] == "get"
    rep["prefill_tokens_saved"] = int(round((np.minimum(c["hit_blocks"][g], c["blocks"][g]) * bs[g]).sum()))
    rep["tiers"] = _tiers(c, lk, bs)
    rep["tenants"] = _tenants(c["tenant"][lk], req, hit)
    rep["clients"] = _clients(c, lk, bs)
    rep["prefix_buckets"] = _prefix_buckets(req, hit)
    rep["timeline"], rep["timeline_step_s"] = _timeline(c["time"][lk], req, hit)
    rep["gets"] = _totals(c, c["kind"] == "get")
    rep["puts"] = _totals(c, c["kind"] == "put")
    rep["removals"] = {k: _by_age(c, c["kind"] == k) for k in ("evict", "expire")}
    return rep


def _columns(table) -> dict[str, np.ndarray]:
    """Numeric columns as finite, non-negative float64; strings as object arrays.
    Rows without a finite time are dropped: they cannot be placed anywhere."""
    c = {}
    for name in _NUMERIC:
        raw = table.column(name).to_numpy(zero_copy_only=False).astype(np.float64) if table.num_rows else np.zeros(0)
        c[name] = np.where(np.isfinite(raw), raw, np.nan if name == "time" else 0.0)
    for name in _STRINGS:        # a table from before a column existed reads as all ""
        values = table.column(name).to_pylist() if name in table.column_names else [""] * table.num_rows
        c[name] = np.array([s or "" for s in values], dtype=object)
    keep = np.isfinite(c["time"])
    return {k: (v[keep] if k in _STRINGS + ("time",) else np.maximum(v[keep], 0.0))
            for k, v in c.items()}


def _block_sizes(c) -> tuple[np.ndarray, bool]:
    """Tokens per block for every row: its own where it has one, else its tenant's most
    frequent, else the most frequent overall. False if no row has one (count blocks then)."""
    known = (c["tokens"] > 0) & (c["blocks"] > 0)
    own = np.where(known, c["tokens"] / np.maximum(c["blocks"], 1), 0.0)
    if not known.any():
        return np.ones_like(own), False
    fallback = _mode(own[known])
    names, inv = np.unique(c["tenant"], return_inverse=True)
    best: dict[int, tuple[int, float]] = {}
    pairs, counts = np.unique(np.stack([inv[known], own[known]]), axis=1, return_counts=True)
    for t, b, n in zip(pairs[0].astype(int), pairs[1], counts):
        if n > best.get(t, (0, 0.0))[0]:
            best[t] = (n, b)
    per_tenant = np.array([best.get(i, (0, fallback))[1] for i in range(len(names))])
    return np.where(known, own, per_tenant[inv]), True


def _mode(x: np.ndarray) -> float:
    values, counts = np.unique(x, return_counts=True)
    return float(values[np.argmax(counts)])


def _rate(requested: float, hit: float) -> dict:
    return {"requested": int(round(requested)), "hit": int(round(hit)),
            "hit_rate": float(hit / requested) if requested > 0 else None}


def _kind_counts(kinds: np.ndarray) -> dict[str, int]:
    names, counts = np.unique(kinds, return_counts=True)
    return {str(k): int(n) for k, n in zip(names, counts)}


def _tiers(c, lk: np.ndarray, bs: np.ndarray) -> dict:
    """Hit tokens per tier (lookups), bytes served per tier (gets; a batch served by several
    tiers is split by its block counts), bytes evicted per tier."""
    counts = {t: c[f"hits_{t}"] for t in TIERS}
    hit_tokens = {t: float((counts[t][lk] * bs[lk]).sum()) for t in TIERS}
    total = sum(hit_tokens.values())
    g = c["kind"] == "get"
    served_blocks = sum(counts[t][g] for t in TIERS)
    ev = c["kind"] == "evict"
    out = {}
    for t in TIERS:
        share = np.divide(counts[t][g], served_blocks, out=np.zeros_like(served_blocks), where=served_blocks > 0)
        out[t] = {"hit_tokens": int(round(hit_tokens[t])), "share": hit_tokens[t] / total if total else None,
                  "bytes_served": int(round((c["nbytes"][g] * share).sum())),
                  "bytes_evicted": int(c["nbytes"][ev & (c["tier"] == t)].sum())}
    return out


def _tenants(tenants: np.ndarray, req: np.ndarray, hit: np.ndarray) -> list[dict]:
    if not len(tenants):
        return []
    names, inv = np.unique(tenants, return_inverse=True)
    r, h, n = (np.bincount(inv, weights=w, minlength=len(names)) for w in (req, hit, np.ones_like(req)))
    rows = [{"tenant": str(t), "lookups": int(k), **_rate(a, b)} for t, k, a, b in zip(names, n, r, h)]
    return sorted(rows, key=lambda x: (-x["requested"], x["tenant"]))


def _clients(c, lk: np.ndarray, bs: np.ndarray) -> list[dict]:
    """Lookups by the engine that asked (the daemon labels vllm, sglang, kvcache, other): hit rate,
    hit tokens per tier, mean lookup latency. Lookups without a label are not listed."""
    rows = []
    for name in sorted(set(c["client"][lk]) - {""}):
        m = lk & (c["client"] == name)
        req, hit = c["blocks"][m] * bs[m], np.minimum(c["hit_blocks"][m], c["blocks"][m]) * bs[m]
        rows.append({"client": str(name), "lookups": int(m.sum()), **_rate(req.sum(), hit.sum()),
                     "hit_tokens_by_tier": {t: int(round((c[f"hits_{t}"][m] * bs[m]).sum())) for t in TIERS},
                     "mean_lookup_ms": float(c["latency_s"][m].mean() * 1e3)})
    return rows


def _prefix_buckets(req: np.ndarray, hit: np.ndarray) -> list[dict]:
    idx = np.searchsorted([edge for edge, _ in PREFIX_BUCKETS], req, side="right")
    out = []
    for i, (_, label) in enumerate(PREFIX_BUCKETS):
        sel = idx == i
        out.append({"bucket": label, "lookups": int(sel.sum()), **_rate(req[sel].sum(), hit[sel].sum())})
    return out


def _timeline(times: np.ndarray, req: np.ndarray, hit: np.ndarray) -> tuple[list[dict], int]:
    """Hit rate per time bucket; the bucket is the smallest step that gives at most 72 points."""
    if not len(times):
        return [], 0
    span = float(times.max() - times.min())
    step = next((s for s in _TIME_STEPS if span / s <= 72), max(_TIME_STEPS[-1], int(span / 72)))
    starts = np.floor(times / step) * step
    keys, inv = np.unique(starts, return_inverse=True)
    r, h, n = (np.bincount(inv, weights=w, minlength=len(keys)) for w in (req, hit, np.ones_like(req)))
    return [{"start": float(k), "lookups": int(c), **_rate(a, b)} for k, c, a, b in zip(keys, n, r, h)], step


def _totals(c, sel: np.ndarray) -> dict:
    blocks = c["blocks"][sel]
    return {"count": int(sel.sum()), "blocks": int(blocks.sum()),
            "hit_blocks": int(np.minimum(c["hit_blocks"][sel], blocks).sum()), "bytes": int(c["nbytes"][sel].sum())}


def _by_age(c, sel: np.ndarray) -> dict:
    """Blocks removed per age bucket. Events carry the mean age of their batch, so a batch
    counts whole in its mean's bucket."""
    idx = np.searchsorted([edge for edge, _ in AGE_BUCKETS], c["mean_age_s"][sel], side="right")
    per = np.bincount(idx, weights=c["blocks"][sel], minlength=len(AGE_BUCKETS))
    return {"events": int(sel.sum()), "blocks": int(c["blocks"][sel].sum()),
            "bytes": int(c["nbytes"][sel].sum()),
            "by_age": {label: int(per[i]) for i, (_, label) in enumerate(AGE_BUCKETS)}}


# -------------------------------------------------------------------- terminal
def print_summary(rep: dict, html_path: str | None = None) -> None:
    print(describe_source(rep))
    if not rep["events"]:
        print(empty_message(rep))
        return
    u, lk = rep["unit"], rep["lookups"]
    print_table([("lookups", f"{lk['count']:,}"),
            (f"{u[:-1]} hit rate", f"{_pct(lk['hit_rate'])}  ({lk['hit']:,} of {lk['requested']:,} {u})"),
            (f"prefill {u} saved", f"{rep['prefill_tokens_saved']:,}")])
    if u == "blocks":
        print("  (no event carries a block size, so counts are in blocks)")
    print(f"\nhit {u} by tier")
    print_table([(t, f"{_pct(v['share']):>6}  {v['hit_tokens']:,}") for t, v in rep["tiers"].items()], indent=2)
    print("\nper tenant")
    _grid(["tenant", "lookups", f"requested {u}", f"hit {u}", "hit rate"],
          [[r["tenant"] or "(none)", r["lookups"], r["requested"], r["hit"], _pct(r["hit_rate"])]
           for r in rep["tenants"][:30]])
    if len(rep["tenants"]) > 30:
        print(f"  ... and {len(rep['tenants']) - 30} more (see --json)")
    if rep.get("clients"):
        print("\nper client (the engine that asked)")
        _grid(["client", "lookups", f"requested {u}", f"hit {u}", "hit rate", "dram", "nvme", "object", "lookup ms"],
              [[r["client"], r["lookups"], r["requested"], r["hit"], _pct(r["hit_rate"]),
                *(r["hit_tokens_by_tier"][t] for t in TIERS), f"{r['mean_lookup_ms']:.2f}"] for r in rep["clients"]])
    print(f"\nper prompt length ({u} requested per lookup)")
    _grid(["length", "lookups", f"requested {u}", f"hit {u}", "hit rate"],
          [[b["bucket"], b["lookups"], b["requested"], b["hit"], _pct(b["hit_rate"])] for b in rep["prefix_buckets"]])
    print("\nbytes")
    rows = [(f"served from {t}", human_size(v["bytes_served"])) for t, v in rep["tiers"].items()]
    rows += [("written by puts", human_size(rep["puts"]["bytes"]))]
    rows += [(f"evicted from {t}", human_size(v["bytes_evicted"]))
             for t, v in rep["tiers"].items() if v["bytes_evicted"]]
    print_table(rows, indent=2)
    ev, ex = rep["removals"]["evict"], rep["removals"]["expire"]
    print("\nblocks evicted and expired, by age since written")
    _grid(["age", "evicted", "expired"], [[a, ev["by_age"][a], ex["by_age"][a]] for a in ev["by_age"]])
    if html_path:
        print(f"\nHTML report with plots: {html_path}")


def describe_source(rep: dict) -> str:
    line = f"kvcache report: {rep.get('source', '?')} ({rep.get('files', 0)} files, {rep['events']:,} events"
    if rep["events"]:
        line += f", {_when(rep['first_time'])} to {_when(rep['last_time'])} UTC"
    return line + ")"


def empty_message(rep: dict) -> str:
    since = f" since {_when(rep['since'])} UTC" if rep.get("since") is not None else ""
    return (f"no events recorded{since}. The daemon records them when [store] event_log = true "
            "(the default); a running daemon's events become readable within about 10 s.")


def _when(t: float) -> str:
    try:
        return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    except (OverflowError, OSError, ValueError):
        return str(t)


def _pct(r: float | None) -> str:
    return "-" if r is None else f"{r:.1%}"


def _grid(header: list[str], rows: list[list]) -> None:
    cells = [header] + [[f"{v:,}" if isinstance(v, int) else str(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  " + "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
