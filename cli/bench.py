"""`kvcache bench BENCHMARK`: one verb per benchmark of kvcache.benchmarks (benchmarks/). Their
options and the module that runs each live there (`benchmarks/verbs.py`, also what
`python -m kvcache.benchmarks.NAME` parses); this module adds the verbs to the `kvcache` parser.
"""

from __future__ import annotations

import argparse

from kvcache.benchmarks.verbs import VERBS


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="benchmarks: tiers, daemon, lmcache, vllm, model, engine, KV codecs, "
                                            "cold-warm, decode profile, serve",
                              description="Benchmarks on this machine, each against a baseline measured in the "
                                          "same run; JSON results go to benchmarks/results/.")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    for name, verb in VERBS.items():
        # an epilog keeps its line breaks (tables, examples); a verb without one wraps its description
        fmt = argparse.RawDescriptionHelpFormatter if verb.epilog else argparse.HelpFormatter
        verb.configure(sub.add_parser(name, help=verb.help, description=verb.description, epilog=verb.epilog,
                                      formatter_class=fmt))
    return p
