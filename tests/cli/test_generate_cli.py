"""`kvcache generate` at its edges, through the command line's main(): what reaches stdout while a
request streams, broken or missing inputs as one clear error line. A real process where the
process is the point: a reader that leaves (SIGPIPE), and what a run prints on its way out."""

import subprocess
import sys

import pytest
import torch

from kvcache.cli.fmt import escape_controls
from kvcache.cli.generate import printable
from tests.cli.command import kv, kv_process


@pytest.fixture
def model_dir(v4_tiny_checkpoint):
    return v4_tiny_checkpoint


def test_printable_holds_back_a_partial_character_and_a_possible_stop_string():
    assert printable("ab\ufffd", True, ()) == 2                  # the character's bytes are still coming
    assert printable("ab\ufffd", False, ()) == 3                 # finished: all of it
    assert printable("abcdef", True, ("xyz",)) == 4              # "ef" may begin "xyz"...
    assert printable("abcdef", True, ("x", "longer")) == 1       # ...the longest stop string counts
    assert printable("ab", True, ("longer",)) == 0


def test_control_characters_are_escaped_and_other_text_kept():
    assert escape_controls("a\x1b[31mb\x07\r") == "a\\x1b[31mb\\x07\\r"
    assert escape_controls("é 日本\tx\n") == "é 日本\tx\n"                 # any script, tabs, newlines
    assert escape_controls("\u200b\x00\x7f") == "\\u200b\\x00\\x7f"


def test_text_before_a_stop_string_never_reaches_stdout(model_dir):
    base = ("generate", "--model", str(model_dir), "--prompt", "A prefix cache", "--max-tokens", "24", "--ignore-eos")
    free = kv(*base).stdout
    assert len(free) > 12
    # demo weights emit control bytes (ESC, BEL): they reach the terminal escaped
    assert "\\x1b" in free and all(c.isprintable() or c in "\n\t" for c in free), repr(free)
    stop = free[6:10]                                            # spans tokens: found only after it is complete
    cut = kv(*base, "--stop", stop)
    assert cut.stdout == free[: free.find(stop)] and "finish: stop" in cut.stderr


def test_a_reader_that_leaves_ends_the_run_without_a_traceback(model_dir):
    p = subprocess.Popen([sys.executable, "-m", "kvcache.cli.main", "generate", "--model", str(model_dir),
                          "--prompt", "hi", "--max-tokens", "64", "--ignore-eos"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()                                             # `| head -c 0`: gone before the first token
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_truncated_weights_file_is_one_clear_error(model_dir, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    shard = next(bad.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    r = kv("generate", "--model", str(bad), "--prompt-ids", "1,2,3", check=False)
    assert r.returncode == 2 and "not a readable safetensors file" in r.stderr and "Traceback" not in r.stderr


def test_token_ids_need_no_tokenizer_and_text_says_so(model_dir, tmp_path):
    import shutil
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    (bare / "tokenizer.json").unlink()
    ok = kv("generate", "--model", str(bare), "--prompt-ids", "5,6,7", "--max-tokens", "3", "--ignore-eos")
    assert len(ok.stdout.split()) == 3 and "3 generated" in ok.stderr
    r = kv("generate", "--model", str(bare), "--prompt", "hello", check=False)
    assert r.returncode == 2 and "need a tokenizer" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_device_this_machine_lacks_is_one_clear_error(model_dir):
    r = kv("generate", "--model", str(model_dir), "--prompt-ids", "1,2", "--device", "cuda", check=False)
    assert r.returncode == 2 and "CUDA build of torch" in r.stderr and "Traceback" not in r.stderr


def test_bad_lists_and_paths_are_refused_up_front(tmp_path, capsys):
    from kvcache.cli.main import build_parser
    for argv, what in ((("bench", "engine", "--batches", "0"), "positive integers"),
                       (("bench", "engine", "--configs", ","), "names nothing"),
                       (("model", "init", "--config", "v4-tiny", "--out", "x", "--shard-mib", "0"), "not a positive")):
        with pytest.raises(SystemExit) as e:          # argparse: usage line, the reason, status 2
            build_parser().parse_args(argv)
        assert e.value.code == 2 and what in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    r = kv("model", "init", "--config", "v4-tiny", "--out", str(tmp_path / "file"), check=False)
    assert r.returncode == 2 and "is a file" in r.stderr


def test_a_daemon_that_is_not_running_is_one_warning_and_an_uncached_run(model_dir):
    from tests.server.test_serve_process import free_port
    # a process: an unclosed session would be reported as the interpreter exits
    r = kv_process("generate", "--model", str(model_dir), "--prompt", "A prefix cache", "--max-tokens", "4",
                   "--cache", f"http://127.0.0.1:{free_port()}", "--cache-mode", "exact")
    warnings = [line for line in r.stderr.splitlines() if "is unreachable" in line]
    assert r.returncode == 0 and len(warnings) == 1 and "generating without the cache" in warnings[0], r.stderr
    assert "Unclosed" not in r.stderr and "Traceback" not in r.stderr
    assert "[cache: 0 of " in r.stderr and "every 512 prompt tokens (cache.snapshot_interval)" in r.stderr


def test_the_usage_line_says_why_a_short_exact_prompt_leaves_no_snapshot():
    from kvcache.cli.generate import usage_line
    from kvcache.engine.config import CacheConfig
    from kvcache.engine.cache.prefix_cache import CacheUsage
    short, long = CacheUsage(prompt_tokens=100), CacheUsage(prompt_tokens=700, cached_tokens={"dram": 512})
    assert "snapshot_interval" in usage_line(short, CacheConfig(mode="exact"))
    assert usage_line(long, CacheConfig(mode="exact")) == \
        "[cache: 512 of 700 prompt tokens cached (dram 512), 0 replayed, 0.0 MB loaded in 0 ms]"
    assert "snapshot" not in usage_line(short, CacheConfig(mode="replay"))
