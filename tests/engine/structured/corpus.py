"""The JSON-schema corpus (schemas/NN-name.json, one real-world-style schema each) and its checks.

    load_schemas()            [(name, schema)] in file order: "01-user-profile", ...
    check(schema, text)       the parsed value; an AssertionError saying where and why otherwise
    build_demo(name, root)    a random-weight demo checkpoint of configs/models/NAME.json under root

Nearly every string is bounded (maxLength, an enum, a pattern with bounded repetition) and nearly
every map's keys follow a bounded patternProperties: a random-weight model has no reason to close
a string, so only the grammar's bounds end its output within max_tokens (as they would end a real
model's runaway). The exceptions: 62-unbounded-note, written without any bounds, and
22-shipping-address, an allOf whose parts cannot forbid extra properties. JSON numbers stay
unbounded in their digits, as JSON Schema has no way to bound them.

Every schema compiles with llguidance 1.9.1 as engine/structured/compiler.py configures it. What it
refuses (so the corpus leaves it out, or says it another way):

    oneOf through $ref          "oneOf constraints are not supported": llguidance proves the branches
                                disjoint only when they are inline (a const discriminator, distinct
                                types); the compiler leaves `coerce_one_of` off, so a oneOf of $refs
                                is refused. The corpus writes such unions inline, or as anyOf
    propertyNames               unimplemented (patternProperties + additionalProperties: false is)
    uniqueItems, contains, minContains, not, if/then/else, dependentRequired,
    unevaluatedProperties, $dynamicRef     unimplemented
    a remote $ref               not fetched
    an unknown format           refused (the formats used here are all llguidance's)
    look-around, back-references in a pattern    not regular: the pattern does not parse

What `check` validates: jsonschema's Draft 2020-12 validator with its format checker, except
"date-time" and "time", checked against RFC 3339's grammar here. The validator's own check
(rfc3339-validator) refuses a lowercase "t"/"z" and a leap second, both of which RFC 3339 allows
and llguidance's grammar produces. llguidance also allows second 60 at any minute, where RFC 3339
means it for a leap second only (23:59:60 UTC); that needs the leap-second table, so it is not
checked here either. Formats this environment cannot check ("uri" needs rfc3987, "hostname" fqdn,
"duration" isoduration) pass unchecked, as jsonschema's checker does without those packages.
"""

from __future__ import annotations

import datetime
import json
import os
import re

from jsonschema import Draft202012Validator, FormatChecker

SCHEMA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas")

# RFC 3339 section 5.6: full-time = partial-time time-offset; "T" and "Z" may be lowercase
_TIME = r"(\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-](\d{2}):(\d{2}))"
_TIME_RE = re.compile(_TIME)
_DATE_TIME_RE = re.compile(r"(\d{4})-(\d{2})-(\d{2})[Tt]" + _TIME)


def load_schemas() -> list[tuple[str, dict]]:
    """Every schema of the corpus, by file name (without .json), in file order."""
    out = []
    for f in sorted(os.listdir(SCHEMA_DIR)):
        if f.endswith(".json"):
            with open(os.path.join(SCHEMA_DIR, f), encoding="utf-8") as fh:
                out.append((f[:-5], json.load(fh)))
    return out


def check(schema: dict, text: str):
    """`text` parsed, if it is JSON valid against `schema`; an AssertionError naming the failure."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise AssertionError(f"not JSON ({e}): {_clip(text)}") from None
    errors = sorted(_validator(schema).iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "(root)"
        raise AssertionError(f"{len(errors)} schema error(s); first at {where}: {_clip(errors[0].message)}\n"
                             f"output: {_clip(text)}")
    return value


def build_demo(name: str, root: str) -> str:
    """root/name: random-weight weights and tokenizer for configs/models/NAME.json."""
    from kvcache.engine.checkpoint.demo import config_path, write_demo_checkpoint
    out = os.path.join(root, name)
    write_demo_checkpoint(config_path(name), out)
    return out


def _validator(schema: dict) -> Draft202012Validator:
    return Draft202012Validator(schema, format_checker=FORMAT_CHECKER)


def _is_time(groups: tuple) -> bool:
    hour, minute, second, _frac, _zone, off_h, off_m = groups
    offset_ok = off_h is None or (int(off_h) <= 23 and int(off_m) <= 59)
    return int(hour) <= 23 and int(minute) <= 59 and int(second) <= 60 and offset_ok


def _rfc3339_date_time(value) -> bool:
    if not isinstance(value, str):
        return True                       # formats constrain strings only
    m = _DATE_TIME_RE.fullmatch(value)
    if m is None:
        return False
    try:         # RFC 3339 has a year 0000, Python does not: 2000 has its leap rule (400-year cycle)
        datetime.date(int(m[1]) or 2000, int(m[2]), int(m[3]))
    except ValueError:
        return False
    return _is_time(m.groups()[3:])


def _rfc3339_time(value) -> bool:
    if not isinstance(value, str):
        return True
    m = _TIME_RE.fullmatch(value)
    return m is not None and _is_time(m.groups())


def _format_checker() -> FormatChecker:
    checker = FormatChecker(formats=())
    checker.checkers = dict(Draft202012Validator.FORMAT_CHECKER.checkers)
    checker.checks("date-time")(_rfc3339_date_time)
    checker.checks("time")(_rfc3339_time)
    return checker


FORMAT_CHECKER = _format_checker()


def _clip(text: str, n: int = 600) -> str:
    return text if len(text) <= n else text[:n] + f"... ({len(text)} characters)"
