"""`kvcache bench structured`'s JSON document (settings, ratios, targets, what limits them) and the
table it prints. The measurements are benchmarks/structured.py's.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import statistics

TARGETS = {"structured_decode_vs_free_b1": 0.9, "structured_decode_vs_free_b8": 0.9}


def summarize_ab(pairs: list) -> dict:
    """(constrained, free) Side pairs of one batch size: the ratio (median of each pair's own), the
    rates over all pairs, step times, and the fill's time against the steps'."""
    def median_ms(sides):
        steps = [s for side in sides for s in side.step_s]
        return statistics.median(steps) * 1e3 if steps else None

    def rate(sides):
        return sum(x.decode_tokens for x in sides) / max(sum(x.decode_s for x in sides), 1e-9)
    cs, fs = [c for c, _ in pairs], [f for _, f in pairs]
    n_steps = max(sum(len(c.step_s) + 1 for c in cs), 1)
    fill_ms, apply_ms, wait_ms = (sum(getattr(c, k) for c in cs) / n_steps * 1e3
                                  for k in ("fill_s", "apply_s", "wait_s"))
    finish: dict[str, int] = {}
    for c in cs:
        for k, v in c.finish.items():
            finish[k] = finish.get(k, 0) + v
    ratios = [c.tokens_per_s / f.tokens_per_s for c, f in pairs]
    return {"ratio": statistics.median(ratios), "ratios": ratios, "pairs": len(pairs),
            "constrained_tokens_per_s": rate(cs), "free_tokens_per_s": rate(fs), "ratio_of_totals": rate(cs) / rate(fs),
            "decode_tokens": sum(c.decode_tokens for c in cs), "decode_steps": sum(len(c.step_s) for c in cs),
            "same_decode_steps": all(c.counts == f.counts for c, f in pairs),
            "step_ms_constrained": median_ms(cs), "step_ms_free": median_ms(fs),
            "fill_ms_per_step": fill_ms, "apply_ms_per_step": apply_ms, "fill_wait_ms_per_step": wait_ms,
            "fill_hidden_fraction": 1 - wait_ms / fill_ms if fill_ms else None,
            "masked_rows_per_step": sum(c.masked_rows for c in cs) / n_steps,
            "fill_fraction_of_step": sum(c.fill_s for c in cs) / max(sum(c.all_steps_s for c in cs), 1e-9),
            "constrained_finish_reasons": finish}


def document(settings, schemas: list[tuple[str, dict]], request_schemas: list[str], decode: dict, grammar: dict,
             setup_s: float) -> dict:
    doc = {"benchmark": "structured", "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(),
           "config": {**dataclasses.asdict(settings), "weights": "random (demo checkpoint)",
                      "schemas_source": settings.schemas or "built-in (benchmarks/structured.py)",
                      "schemas": [name for name, _ in schemas], "request_schemas": request_schemas,
                      "engine": "compiled" if settings.compile else "eager", "sampling": "temperature 1, seeded",
                      "setup_s": setup_s,
                      "baseline": "the same requests without a constraint, max_tokens = the constrained one's "
                                  "generated count, ignore_eos (the same decode steps), in the same run"},
           "decode": decode, "grammar": grammar, "targets": TARGETS}
    for key, r in decode.items():
        doc[f"structured_decode_vs_free_{key}"] = r["ratio"]
        doc[f"mask_fill_fraction_of_step_{key}"] = r["fill_fraction_of_step"]
    for name, g in grammar.items():
        doc[f"compile_p50_ms_{name}"] = g["compile"]["p50_ms"]
        doc[f"compile_p99_ms_{name}"] = g["compile"]["p99_ms"]
    doc["notes"] = notes(doc)
    return doc


def notes(doc: dict) -> dict:
    out = {}
    for key, r in doc["decode"].items():
        if not r["same_decode_steps"]:
            out[f"steps_{key}"] = "the free side generated other counts than the constrained one: not comparable"
        out[f"hidden_{key}"] = (f"the fill took {r['fill_ms_per_step']:.3f} ms a step in its worker; sampling "
                                f"waited {r['fill_wait_ms_per_step']:.3f} ms a step for it "
                                f"({100 * (r['fill_hidden_fraction'] or 0):.0f} % hidden) and spent "
                                f"{r['apply_ms_per_step']:.3f} ms a step in StepMasks.apply in all, masking "
                                f"{r['masked_rows_per_step']:.2f} rows")
    return out


def _ms(p: dict) -> str:
    return f"{p['p50_ms']:.3f} / {p['p99_ms']:.3f}"


def format_table(doc: dict) -> str:
    lines = ["decode tokens/s over all pairs, constrained | free (same decode steps); ratio: the median pair's:"]
    for key, r in doc["decode"].items():
        lines.append(f"  {key:>4}  {r['constrained_tokens_per_s']:8.1f} | {r['free_tokens_per_s']:8.1f} | ratio "
                     f"{r['ratio']:.3f}   step ms {r['step_ms_constrained']:.2f} | {r['step_ms_free']:.2f}   fill "
                     f"{r['fill_ms_per_step']:.3f} ms/step ({100 * r['fill_fraction_of_step']:.2f} % of the step), "
                     f"apply {r['apply_ms_per_step']:.3f} ms/step")
    for name, g in doc["grammar"].items():
        fills = ", ".join(f"{n} rows {_ms(p)}" for n, p in g["fill_batch"].items())
        lines.append(f"  {name} tokenizer ({g['tokenizer_vocab']} tokens, width {g['logit_width']}), ms p50 / p99: "
                     f"compile {_ms(g['compile'])}; fill_batch {fills}; apply one row {_ms(g['apply_row'])}")
    for key in doc["decode"]:
        k = f"structured_decode_vs_free_{key}"
        target = doc["targets"].get(k)
        verdict = "" if target is None else f" (target >= {target}: {'PASS' if doc[k] >= target else 'MISS'})"
        lines.append(f"  {k} = {doc[k]:.3f}{verdict}")
    lines += [f"  {k}: {v}" for k, v in doc["notes"].items()]
    return "\n".join(lines)
