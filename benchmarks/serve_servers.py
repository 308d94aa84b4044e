"""The servers `kvcache bench serve` starts, one at a time, on the same weights:

    kvcache serve --model CKPT --config T.toml    T: the run's [engine] settings and [cache]
                                                  (cache on: exact mode; off: enabled = false)
    transformers serve COPY [--continuous-batching]
                                                  COPY: the checkpoint as transformers' own
                                                  DeepseekV4ForCausalLM wrote it (save_pretrained
                                                  of benchmarks/model.py's hf_twin: the same
                                                  weights), with the same tokenizer.json

Each runs in its own session with its output in a log file and is stopped on the way out
(benchmarks/daemon_servers.py's process helpers). Both are ready when their own route says so:
/ready (the engine is warm) and /health (transformers loads a forced model before it listens).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from kvcache.benchmarks.daemon_servers import _free_port, _spawn, _wait_ready

START_TIMEOUT_S = 300.0       # v4-small on 2 cores: a weights checksum and a warm-up before /ready


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    model: str                # what requests send as `model`
    argv: list[str]
    log: str
    settings: dict = field(default_factory=dict)


def _toml(sections: dict) -> str:
    return "".join(f"[{sec}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in kv.items()) + "\n"
                   for sec, kv in sections.items())


def _with_env(argv: list[str], env: dict[str, str]) -> list[str]:
    """argv run through env(1) with these variables set (the same for every server of a run)."""
    return ["env", *(f"{k}={v}" for k, v in env.items()), *argv] if env else argv


def _ready(url: str):
    return lambda: urllib.request.urlopen(url, timeout=2).status == 200


def start_kvcache(cleanup: contextlib.ExitStack, root: str, name: str, checkpoint: str, engine: dict,
                  cache: dict, env: dict[str, str]) -> Server:
    """`kvcache serve --model` on a fresh data directory, with [engine] and [cache] from a file."""
    path, port = os.path.join(root, f"{name}.toml"), _free_port()
    sections = {"engine": engine, "cache": cache}
    with open(path, "w") as f:
        f.write(_toml(sections))
    argv = [sys.executable, "-m", "kvcache.cli.main", "serve", "--model", checkpoint, "--config", path,
            "--data-dir", os.path.join(root, f"{name}-data"), "--port", str(port),
            "--served-model-name", "bench", "--gc-interval", "3600"]
    argv = _with_env(argv, env)
    log, url = os.path.join(root, f"{name}.log"), f"http://127.0.0.1:{port}"
    proc = _spawn(cleanup, argv, log)
    _wait_ready(proc, _ready(url + "/ready"), log, f"kvcache serve ({name})", START_TIMEOUT_S)
    return Server(name, url, "bench", argv, log, sections)


def transformers_copy(checkpoint: str, out: str) -> str:
    """The checkpoint in transformers' own format: our loader's weights in its DeepseekV4ForCausalLM
    (without the MTP block, which it has no place for), save_pretrained, and the same tokenizer."""
    from transformers import PreTrainedTokenizerFast
    from kvcache.benchmarks.model import hf_twin
    from kvcache.engine.llm import load_checkpoint
    from kvcache.engine.tokenizer import BOS, EOS, PAD
    model, _ = load_checkpoint(checkpoint)
    hf_twin(model, model.config).save_pretrained(out)
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(checkpoint, "tokenizer.json"),
                                  bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tok.save_pretrained(out)
    return out


def transformers_tokenizer(copy: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(copy)


def serve_available() -> str | None:
    """Why `transformers serve` cannot run here, or None."""
    try:
        from transformers.utils.import_utils import is_serve_available
    except ImportError as e:
        return f"transformers is not importable: {e}"
    if not is_serve_available():
        return "transformers serve needs its serving extra: pip install 'transformers[serving]'"
    return None


def start_transformers(cleanup: contextlib.ExitStack, root: str, copy: str, continuous_batching: bool,
                       env: dict[str, str]) -> Server:
    name = "transformers" + ("_cb" if continuous_batching else "")
    port = _free_port()
    argv = [sys.executable, "-m", "transformers.cli.transformers", "serve", copy, "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if continuous_batching:
        argv.append("--continuous-batching")
    # offline: the copy is local, and its CLI would look for a newer release on PyPI first
    argv = _with_env(argv, {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
                            **env})
    log, url = os.path.join(root, f"{name}.log"), f"http://127.0.0.1:{port}"
    proc = _spawn(cleanup, argv, log)
    _wait_ready(proc, _ready(url + "/health"), log, f"transformers serve ({name})", START_TIMEOUT_S)
    return Server(name, url, copy, argv, log, {"continuous_batching": continuous_batching})


def last_error(log: str, wait_s: float = 5.0) -> str:
    """The last exception a server logged ("ValueError: ..."): why it refused a request. Waits a
    little: uvicorn logs the traceback after it has sent the 500."""
    deadline = time.monotonic() + wait_s
    while True:
        with open(log, errors="replace") as f:
            found = [ln.strip() for ln in f if re.match(r"[A-Za-z_.]*(Error|Exception): ", ln)]
        if found or time.monotonic() > deadline:
            return found[-1][:300] if found else "(no exception in its log)"
        time.sleep(0.1)
