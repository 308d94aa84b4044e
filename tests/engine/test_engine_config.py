"""The engine's TOML: the shipped configs/engine.toml documents every setting at its default, the
loader is strict (the file and the key named, never a traceback), and `kvcache generate`'s flags
override the file."""

import dataclasses
import pathlib
import re
import tomllib

import pytest

from kvcache.engine.config import CacheConfig, EngineConfig, EngineConfigError

SHIPPED = pathlib.Path(__file__).resolve().parents[2] / "configs" / "engine.toml"


def _write(tmp_path, text: str, name: str = "engine.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_the_shipped_file_is_the_defaults():
    assert EngineConfig.load(str(SHIPPED)) == EngineConfig()
    raw = tomllib.loads(SHIPPED.read_text())
    raw["cache"]["enabled"] = True                        # its [cache] values are the cache's defaults too
    assert EngineConfig.from_dict(raw) == EngineConfig(cache=CacheConfig())


def test_the_shipped_file_documents_every_setting():
    text = SHIPPED.read_text()
    keys = set(re.findall(r"^#? ?(\w+) =", text, re.M)) | set(re.findall(r"^\[cache\.(\w+)\]", text, re.M))
    spelled = {re.sub(r"_(mib|gib)$", "_bytes", k) for k in keys}
    for klass in (EngineConfig, CacheConfig):
        missing = {f.name for f in dataclasses.fields(klass)} - spelled - {"cache"}
        assert not missing, f"configs/engine.toml does not document {klass.__name__}.{sorted(missing)}"


def test_a_cache_section_turns_the_cache_on_and_sizes_have_their_spellings(tmp_path):
    path = _write(tmp_path, '[engine]\nblock_size = 64\ndevice_experts = true\n'
                            '[cache]\nstore = "http://127.0.0.1:8790"\nmode = "exact"\npin_ttl_s = 5\n'
                            'max_pending_save_mib = 1\n[cache.bandwidth]\nnvme = 1e9\n')
    cfg = EngineConfig.load(path)
    assert cfg.block_size == 64 and cfg.device_experts is True and cfg.num_blocks == 512
    c = cfg.cache
    assert (c.store, c.mode, c.pin_ttl_s, c.max_pending_save_bytes) == ("http://127.0.0.1:8790", "exact", 5.0, 1 << 20)
    assert c.bandwidth == {"dram": 2e9, "nvme": 1e9, "object": 1e8}   # a tier left out keeps its guess
    assert EngineConfig.load(_write(tmp_path, 'engine.device_experts = "auto"\n')) == EngineConfig()


@pytest.mark.parametrize("text, said", [
    ("[engine]\nblok_size = 64\n", "unknown setting [engine].blok_size"),
    ("[engine]\ncache = 1\n", "unknown setting [engine].cache"),
    ("[cache]\nsnapshot_intervall = 64\n", "unknown setting [cache].snapshot_intervall"),
    ("[model]\nx = 1\n", "unknown sections ['model']"),
    ('[engine]\nblock_size = "64"\n', "[engine].block_size must be int"),
    ("[engine]\nnum_blocks = 0\n", "[engine].num_blocks must be at least 1"),
    ("[engine]\ncompile = 1\n", "[engine].compile must be bool"),
    ('[engine]\ndevice_experts = "yes"\n', '[engine].device_experts must be "auto" or bool'),
    ("[cache]\nsave = \"no\"\n", "[cache].save must be bool"),
    ("[cache]\nenabled = 1\n", "[cache].enabled must be true or false"),
    ('[cache]\nmode = "fast"\n', "[cache]: cache mode must be 'replay' or 'exact'"),
    ('[cache]\nenabled = false\nmode = "fast"\n', "[cache]: cache mode must be"),   # --cache may turn it on
    ("[cache]\nmax_pending_save_mib = -1\n", "[cache].max_pending_save_mib must be a number of MIB"),
    ("[cache.bandwidth]\nhbm = 1e9\n", "unknown tier 'hbm' in [cache.bandwidth]"),
    ("[cache.bandwidth]\nnvme = 0\n", "[cache.bandwidth].nvme must be a positive number"),
    ("engine = 3\n", "[engine] must be a table"),
])
def test_a_bad_setting_is_an_error_naming_the_file_and_the_key(tmp_path, text, said):
    path = _write(tmp_path, text)
    with pytest.raises(EngineConfigError) as e:
        EngineConfig.load(path)
    assert str(e.value).startswith(f"{path}: ") and said in str(e.value), str(e.value)


def test_a_missing_or_broken_file_is_one_clear_error(tmp_path):
    with pytest.raises(EngineConfigError, match="does not exist"):
        EngineConfig.load(str(tmp_path / "nope.toml"))
    with pytest.raises(EngineConfigError, match="is not valid TOML"):
        EngineConfig.load(_write(tmp_path, "[engine\n"))


def _generate_args(*extra):
    from kvcache.cli.main import build_parser
    return build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", *extra])


def test_generate_flags_override_the_file(tmp_path):
    from kvcache.cli.generate import _config
    path = _write(tmp_path, '[engine]\nmax_running = 4\n[cache]\nstore = "/tmp/store"\nsnapshot_interval = 256\n')
    cfg = _config(_generate_args("--config", path, "--cache-mode", "exact", "--compile"))
    assert cfg.max_running == 4 and cfg.compile
    assert (cfg.cache.store, cfg.cache.mode, cfg.cache.snapshot_interval) == ("/tmp/store", "exact", 256)
    off = _write(tmp_path, "[engine]\ncompile = true\n[cache]\nenabled = false\n", "off.toml")
    assert _config(_generate_args("--config", off)) == EngineConfig(compile=True)
    assert _config(_generate_args("--config", off, "--cache", "http://h:1")).cache == CacheConfig(store="http://h:1")
    assert _config(_generate_args("--cache-config", path)).cache.store == "/tmp/store"   # the older spelling
    assert _config(_generate_args()) == EngineConfig()


def test_generate_cache_flags_turn_a_disabled_cache_on_with_the_files_settings(tmp_path):
    from kvcache.cli.generate import _config
    off = _write(tmp_path, '[cache]\nenabled = false\nmode = "exact"\nsnapshot_interval = 256\n')
    cfg, in_file = EngineConfig.load_with_cache(off)
    assert cfg == EngineConfig() and in_file == CacheConfig(mode="exact", snapshot_interval=256)
    c = _config(_generate_args("--config", off, "--cache", "http://h:1")).cache
    assert (c.store, c.mode, c.snapshot_interval) == ("http://h:1", "exact", 256)
    c = _config(_generate_args("--config", off, "--cache", "http://h:1", "--cache-mode", "replay")).cache
    assert (c.mode, c.snapshot_interval) == ("replay", 256)
    assert EngineConfig.load_with_cache(_write(tmp_path, "", "empty.toml")) == (EngineConfig(), None)


def test_generate_cache_config_on_a_file_without_a_cache_is_an_error(tmp_path):
    from kvcache.cli.generate import _config
    off = _write(tmp_path, "[cache]\nenabled = false\n", "off.toml")
    bare = _write(tmp_path, "[engine]\nmax_running = 4\n", "bare.toml")
    for path in (off, bare):
        with pytest.raises(ValueError, match="the file's cache is off") as e:
            _config(_generate_args("--cache-config", path))
        assert "pass --cache STORE, or set enabled = true" in str(e.value)
    assert _config(_generate_args("--cache-config", off, "--cache", "/tmp/s")).cache == CacheConfig(store="/tmp/s")
    assert _config(_generate_args("--config", off)).cache is None       # --config: an uncached run, as asked


def test_generate_with_a_bad_file_is_one_error_line(tmp_path):
    from tests.cli.test_model_cli import kv
    path = _write(tmp_path, "[engine]\nblok_size = 64\n")
    r = kv("generate", "--model", str(tmp_path / "absent"), "--prompt", "x", "--config", path, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{path}: unknown setting [engine].blok_size" in r.stderr
    assert "given here override the file" in " ".join(kv("generate", "--help").stdout.split())
