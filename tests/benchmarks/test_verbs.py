"""Every benchmark is one verb: `kvcache bench VERB` and `python -m kvcache.benchmarks.MODULE` parse
the same options (reports: benchmarks/results under the current directory, and results/ beside the
package) and run the module's `run_args`."""

import argparse
import importlib
import os

import pytest

from kvcache.benchmarks import verbs
from kvcache.cli import bench


def _kvcache_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcache")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize("name", sorted(verbs.VERBS))
def test_each_verb_parses_and_names_a_runnable_module(name):
    verb = verbs.VERBS[name]
    module = importlib.import_module(f"kvcache.benchmarks.{verb.module}")
    assert callable(module.run_args) and callable(module.main)
    parsed = _kvcache_parser().parse_args(["bench", name])
    assert parsed.func == verb.run and parsed.out_dir == "benchmarks/results"


@pytest.mark.parametrize("module", sorted(v.module for v in verbs.VERBS.values()))
def test_python_m_writes_beside_the_package(module, capsys):
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"kvcache.benchmarks.{module}").main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"python -m kvcache.benchmarks.{module}" in out
    assert verbs.RESULTS == os.path.join(os.path.dirname(os.path.abspath(verbs.__file__)), "results")


def test_a_bad_value_says_why(capsys):
    with pytest.raises(SystemExit):
        _kvcache_parser().parse_args(["bench", "tiers", "--sizes", "lots"])
    assert "not a size: 'lots'" in capsys.readouterr().err
