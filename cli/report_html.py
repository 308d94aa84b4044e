"""The HTML page of `kvcache report`: the summary tables plus five PNG plots, one file.

Plots are drawn from the report dict (cli/report.py), never from raw events, so the page
shows exactly the numbers --json prints. Images are embedded as base64 `data:` URIs so the
page can be mailed or attached to a ticket as it is. matplotlib is used through `Figure`
and the Agg canvas directly, never pyplot: no global backend state and no display needed.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io

from kvcache.cli.report import TIERS, describe_source, empty_message

_COLORS = {"dram": "#4c72b0", "nvme": "#dd8452", "object": "#55a868", "evict": "#c44e52", "expire": "#8172b3"}
_MAX_BARS = 20

_CSS = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;color:#222}
table{border-collapse:collapse;margin:.5rem 0 1.5rem}td,th{padding:.2rem .8rem;border-bottom:1px solid #ddd}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}img{max-width:100%}.note{color:#666}"""


def write_html(rep: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(rep))


def render_html(rep: dict) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>kvcache report</title>"
             f"<style>{_CSS}</style></head><body><h1>kvcache hit-rate report</h1>",
             f"<p class='note'>{html.escape(describe_source(rep))}</p>"]
    if not rep["events"]:
        parts.append(f"<p><strong>{html.escape(empty_message(rep))}</strong></p></body></html>")
        return "".join(parts)
    u, lk = rep["unit"], rep["lookups"]
    parts.append(_html_table(["", ""], [
        ["lookups", lk["count"]], [f"{u[:-1]} hit rate", _pct(lk["hit_rate"])],
        [f"{u} requested", lk["requested"]], [f"prefill {u} saved", rep["prefill_tokens_saved"]]]))
    for title, plot in (("Hit rate over time", plot_timeline), (f"Hit {u} per tier", plot_tiers),
                        ("Per tenant", plot_tenants), ("Per prompt length", plot_prefix),
                        ("Evictions and expirations by age", plot_removals)):
        parts.append(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
                     f"src=\"data:image/png;base64,{_png(plot, rep)}\">")
        parts.append(_section_table(title, rep))
    parts.append("</body></html>")
    return "\n".join(parts)


def _section_table(title: str, rep: dict) -> str:
    u = rep["unit"]
    if title.startswith("Per tenant"):
        return _html_table(["tenant", "lookups", f"requested {u}", f"hit {u}", "hit rate"],
                           [[r["tenant"] or "(none)", r["lookups"], r["requested"], r["hit"], _pct(r["hit_rate"])]
                            for r in rep["tenants"]])
    if title.startswith("Per prompt"):
        return _html_table(["length", "lookups", f"requested {u}", f"hit {u}", "hit rate"],
                           [[b["bucket"], b["lookups"], b["requested"], b["hit"], _pct(b["hit_rate"])]
                            for b in rep["prefix_buckets"]])
    if title.startswith("Hit") and "tier" in title:
        return _html_table(["tier", f"hit {u}", "share", "bytes served", "bytes evicted"],
                           [[t, v["hit_tokens"], _pct(v["share"]), v["bytes_served"], v["bytes_evicted"]]
                            for t, v in rep["tiers"].items()])
    return ""


def _html_table(header: list[str], rows: list[list]) -> str:
    def cell(tag: str, v) -> str:
        num = isinstance(v, (int, float)) or (isinstance(v, str) and v.endswith("%"))
        text = f"{v:,}" if isinstance(v, int) else str(v)
        return f"<{tag}{' class=n' if num else ''}>{html.escape(text)}</{tag}>"
    head = "".join(cell("th", h) for h in header) if any(header) else ""
    body = "".join("<tr>" + "".join(cell("td", v) for v in r) + "</tr>" for r in rows)
    return f"<table>{'<tr>' + head + '</tr>' if head else ''}{body}</table>"


# -------------------------------------------------------------------- plots
def _png(plot, rep: dict) -> str:
    """Draw one plot into a fresh Figure; a plot with nothing to show says so instead."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(8, 3.4), dpi=100, layout="constrained")
    ax = fig.subplots()
    if not plot(ax, rep):
        ax.clear()
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no data for this plot", ha="center", va="center", color="#666")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plot_timeline(ax, rep: dict) -> bool:
    import matplotlib.dates as mdates
    points = rep["timeline"]
    if not points:
        return False
    when = [dt.datetime.fromtimestamp(p["start"], dt.timezone.utc) for p in points]
    rates = [100 * p["hit_rate"] if p["hit_rate"] is not None else float("nan") for p in points]
    width = dt.timedelta(seconds=rep["timeline_step_s"] * 0.9)
    twin = ax.twinx()
    twin.bar(when, [p["requested"] for p in points], width=width, align="edge", color="#ccc")
    twin.set_ylabel(f"{rep['unit']} requested")
    ax.set_zorder(twin.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.plot([w + width / 2 for w in when], rates, marker="o", ms=3, color=_COLORS["dram"])
    ax.set_ylim(0, 100)
    ax.set_ylabel(f"{rep['unit'][:-1]} hit rate (%)")
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(ax.xaxis.get_major_locator()))
    ax.set_xlabel("time (UTC)")
    return True


def plot_tiers(ax, rep: dict) -> bool:
    values = [rep["tiers"][t]["hit_tokens"] for t in TIERS]
    if not any(values):
        return False
    bars = ax.bar(TIERS, values, color=[_COLORS[t] for t in TIERS])
    shares = [_pct(rep["tiers"][t]["share"]) for t in TIERS]
    ax.bar_label(bars, labels=shares)
    ax.set_ylabel(f"hit {rep['unit']}")
    return True


def plot_tenants(ax, rep: dict) -> bool:
    rows = rep["tenants"][:_MAX_BARS]
    if not rows:
        return False
    labels = [_label(r["tenant"]) for r in rows][::-1]
    rates = [100 * (r["hit_rate"] or 0.0) for r in rows][::-1]
    bars = ax.barh(range(len(rows)), rates, color=_COLORS["dram"])
    ax.set_yticks(range(len(rows)), labels=labels)
    ax.bar_label(bars, labels=[f"{r['requested']:,} {rep['unit']}" for r in rows][::-1], fontsize=8, padding=3)
    ax.set_xlim(0, 115)
    ax.set_xlabel(f"{rep['unit'][:-1]} hit rate (%)" + (f"; top {_MAX_BARS} by {rep['unit']} requested"
                                                   if len(rep["tenants"]) > _MAX_BARS else ""))
    return True


def plot_prefix(ax, rep: dict) -> bool:
    rows = rep["prefix_buckets"]
    if not any(b["lookups"] for b in rows):
        return False
    bars = ax.bar([b["bucket"] for b in rows], [100 * (b["hit_rate"] or 0.0) for b in rows], color=_COLORS["nvme"])
    ax.bar_label(bars, labels=[f"{b['lookups']:,} lookups" for b in rows], fontsize=8)
    ax.set_ylim(0, 110)
    ax.set_ylabel(f"{rep['unit'][:-1]} hit rate (%)")
    ax.set_xlabel(f"prompt length ({rep['unit']} requested per lookup)")
    return True


def plot_removals(ax, rep: dict) -> bool:
    ev, ex = rep["removals"]["evict"]["by_age"], rep["removals"]["expire"]["by_age"]
    if not (any(ev.values()) or any(ex.values())):
        return False
    ages = list(ev)
    x = range(len(ages))
    ax.bar([i - 0.2 for i in x], [ev[a] for a in ages], width=0.4, label="evicted", color=_COLORS["evict"])
    ax.bar([i + 0.2 for i in x], [ex[a] for a in ages], width=0.4, label="expired", color=_COLORS["expire"])
    ax.set_xticks(list(x), labels=ages)
    ax.set_xlabel("age since written (batch mean)")
    ax.set_ylabel("blocks")
    ax.legend()
    return True


def _label(name: str) -> str:
    """Tenant names are user data: keep them short and stop `$` from starting mathtext."""
    name = name or "(none)"
    name = name if len(name) <= 28 else name[:27] + "…"
    return name.replace("$", r"\$")


def _pct(r: float | None) -> str:
    return "-" if r is None else f"{r:.1%}"
