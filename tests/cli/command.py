"""The `kvcache` command in a test, two ways. `kv` runs it in this process through `main()`: argv
in, exit status, stdout and stderr out, which is all most command tests look at, without a fresh
interpreter importing torch for every call. `kv_process` runs it as a real process, for what only a
process shows: the entry point, signals and pipes, tensor-parallel ranks, a second process reading
what the first left, what a process prints on its way out."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import subprocess
import sys

from kvcache.cli.main import main


@dataclasses.dataclass
class Ran:
    """What a run of the command left: the fields of subprocess.CompletedProcess that tests read."""
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def kv(*args: str, check: bool = True) -> Ran:
    """`kvcache ARGS` in this process. main() reconfigures the root logger (its handler writes to
    the stderr captured here); the test process's logging is put back afterwards."""
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = _status(args)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    ran = Ran(args, code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"kvcache {' '.join(args)} exited {code}: {ran.stderr[-3000:]}")
    return ran


def _status(args: tuple[str, ...]) -> int:
    try:
        return main(list(args))
    except SystemExit as e:         # argparse: --help (0), or the usage line and the reason (2)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1


def kv_process(*args: str, check: bool = True, **popen) -> subprocess.CompletedProcess:
    """`python -m kvcache.cli.main ARGS` as a process of its own, text output captured."""
    return subprocess.run([sys.executable, "-m", "kvcache.cli.main", *args], capture_output=True, text=True,
                          check=check, **popen)
