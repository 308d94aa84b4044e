"""What `kvcache bench serve` reports (benchmarks/serve.py runs it): each scenario's figures from
its requests' outcomes, the ratios against their targets, what limits each figure (worked out
from the run's own numbers), and the table it prints.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from kvcache.benchmarks.serve_client import Outcome

# ratio -> (direction, target)
TARGETS = {"serve_ttft_p50_cache_vs_off": ("<=", 0.3), "serve_throughput_vs_transformers": (">=", 3.0),
           "serve_errors": ("<=", 0)}
SCENARIOS = ("cache_on", "cache_off", "transformers")


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(outcomes: list[Outcome], wall_s: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft_s for o in ok]
    later = [o.ttft_s for o in ok if o.turn > 0]
    first = [o.ttft_s for o in ok if o.turn == 0]
    tpot = [o.tpot_s for o in ok if o.tpot_s is not None]
    prompt = sum(o.prompt_tokens or 0 for o in ok)
    cached = [o.cached_tokens for o in ok if o.cached_tokens is not None]
    reasons = collections.Counter((o.error or "")[:120] for o in outcomes if not o.ok)
    return {"requests": len(outcomes), "completed": len(ok), "errors": len(outcomes) - len(ok),
            "error_reasons": dict(reasons), "wall_s": wall_s,
            "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
            "ttft_p50_first_turns_s": _pct(first, 50), "ttft_p50_later_turns_s": _pct(later, 50),
            "tpot_p50_s": _pct(tpot, 50), "e2e_p50_s": _pct([o.e2e_s for o in ok], 50),
            "request_throughput_per_s": len(ok) / wall_s if wall_s > 0 else None,
            "output_tokens_per_s": sum(o.completion_tokens or 0 for o in ok) / wall_s if wall_s > 0 else None,
            "prompt_tokens": prompt,
            "cached_tokens": sum(cached) if len(cached) == len(ok) and ok else None,
            "cached_fraction": sum(cached) / prompt if len(cached) == len(ok) and prompt else None,
            "send_lag_p50_s": _pct([o.sent_s - o.scheduled_s for o in outcomes if o.sent_s is not None], 50)}


def outcome_rows(outcomes: list[Outcome]) -> list[dict]:
    return [dataclasses.asdict(o) for o in outcomes]


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def ratios(summaries: dict) -> dict:
    on, off, tf = (summaries.get(k) for k in SCENARIOS)
    out = {"serve_ttft_p50_cache_vs_off": _ratio(on and on["ttft_p50_s"], off and off["ttft_p50_s"]),
           "serve_throughput_vs_transformers": _ratio(on and on["request_throughput_per_s"],
                                                      tf and tf["request_throughput_per_s"]),
           "serve_errors": sum(s["errors"] for k, s in summaries.items() if k != "transformers")}
    out["targets"] = {k: {"target": f"{op} {t}", "value": out[k],
                          "pass": None if out[k] is None else (out[k] <= t if op == "<=" else out[k] >= t)}
                      for k, (op, t) in TARGETS.items()}
    return out


def notes(doc: dict) -> dict:
    """For each figure, what limits it in this run, from the run's own numbers."""
    w, sc = doc["workload"], doc["scenarios"]
    s = {k: v["summary"] for k, v in sc.items() if "summary" in v}
    return {"ttft": _ttft_note(w, s), "throughput": _throughput_note(w, s, sc.get("transformers", {})),
            "tpot": _tpot_note(doc["config"]["engine"], s),
            "errors": "; ".join(f"{k}: {v['errors']} ({', '.join(v['error_reasons']) or 'none'})"
                                for k, v in s.items()),
            "weights": ("random weights (demo checkpoint): outputs are fixed lengths (ignore_eos on ours, "
                        "min_new_tokens = max_new_tokens on transformers) of greedy picks among the workload's "
                        "words (a +100 logit bias on both servers, so that every token streams as text), the "
                        "same number of tokens in every scenario; speed, not quality"),
            "ttft_definition": ("TTFT = the first streamed chunk with text, from the moment the request is sent "
                                "(queueing included): with every output token a whole word, the first token's")}


def _ttft_note(w: dict, s: dict) -> str:
    on, off = s.get("cache_on"), s.get("cache_off")
    if not on or not off:
        return "a cache scenario did not run"
    later = _ratio(on["ttft_p50_later_turns_s"], off["ttft_p50_later_turns_s"])
    return (f"{w['first_turns']} of {w['requests']} requests are a session's first turn, with nothing to reuse "
            f"and all of them queued at the start; cached fraction {_f(on['cached_fraction'])} of an ideal "
            f"{_f(w['ideal_cached_fraction'])} (the longest prefix each prompt shares with an earlier one, in "
            f"whole snapshot intervals). TTFT p50 with the cache / without: first turns "
            f"{_ms(on['ttft_p50_first_turns_s'])} / {_ms(off['ttft_p50_first_turns_s'])}, later turns "
            f"{_ms(on['ttft_p50_later_turns_s'])} / {_ms(off['ttft_p50_later_turns_s'])} (ratio {_f(later)}). "
            f"TTFT includes queueing behind other requests' prefill on the same cores")


def _tpot_note(engine: dict, s: dict) -> str:
    ours = ", ".join(f"{k} {_ms(v['tpot_p50_s'])}" for k, v in s.items() if k != "transformers")
    text = (f"ours ({ours}) decodes every running request in one step, continuous batching, and a step also "
            f"carries other requests' prefill chunks (up to max_tokens_per_step "
            f"{engine.get('max_tokens_per_step', 512)} tokens), so while prefills queue a token waits for a "
            f"chunk")
    if "transformers" in s:
        text += (f"; transformers ({_ms(s['transformers']['tpot_p50_s'])}) without continuous batching decodes "
                 f"one request at a time: a lone decode step, its queue in TTFT instead")
    return text


def _throughput_note(w: dict, s: dict, tf: dict) -> str:
    span = w["arrival_span_s"]
    walls = ", ".join(f"{k} {v['wall_s'] - span:.1f} s" for k, v in s.items())
    text = (f"arrivals span {span:.1f} s; each scenario ended this long after the last arrival: {walls} (one "
            f"that ends soon after it kept up with the offered load, and its throughput is that load's, not "
            f"its capacity); each session's turns wait for the previous answer")
    if "skipped" in tf:
        return text + f"; transformers skipped: {tf['skipped']}"
    if tf.get("continuous_batching_refused"):
        text += (f"; transformers serve --continuous-batching refused the model ({tf['continuous_batching_refused']}),"
                 f" so it served with sequential generate (one request at a time)")
    return text


def _f(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.0f} ms"


def format_table(doc: dict) -> str:
    lines = [f"{'scenario':<14}{'ok/err':>8}{'TTFT p50':>10}{'p99':>9}{'TPOT p50':>10}{'e2e p50':>9}"
             f"{'req/s':>8}{'tok/s':>8}{'cached':>8}   (ms; cached: fraction of prompt tokens)"]
    for name, sc in doc["scenarios"].items():
        if "summary" not in sc:
            lines.append(f"{name:<14}skipped: {sc.get('skipped')}")
            continue
        v = sc["summary"]
        ms = lambda x: "-" if x is None else f"{x * 1e3:.0f}"  # noqa: E731
        lines.append(f"{name:<14}{v['completed']:>4}/{v['errors']:<3}{ms(v['ttft_p50_s']):>10}{ms(v['ttft_p99_s']):>9}"
                     f"{ms(v['tpot_p50_s']):>10}{ms(v['e2e_p50_s']):>9}{v['request_throughput_per_s']:>8.2f}"
                     f"{v['output_tokens_per_s']:>8.1f}{_f(v['cached_fraction']):>8}")
    for k, t in doc["targets"].items():
        verdict = "-" if t["pass"] is None else ("PASS" if t["pass"] else "MISS")
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        lines.append(f"  {k} = {value} (target {t['target']}: {verdict})")
    return "\n".join(lines)
