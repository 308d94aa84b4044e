"""The model a server hosts: its engine, tokenizers, prompt encoding and the names it answers to.

    open_model_host(spec, ...):       (server/model_api/loading.py runs it after the port opened)
        spec "demo" | "demo:NAME"  ─ the demo checkpoint under <data_dir>/models/NAME, built once
        spec DIR                   ─ that checkpoint
      ─ load_checkpoint ─ LLMEngine(model, tokenizer, config, store) ─ one tiny warm-up request
      ─ AsyncEngine (its thread steps the engine while requests are in flight) ─ ready

The store is the daemon's own BlockStore (in-process, no HTTP hop) or, when the engine config's
[cache] names one (`--cache URL`), what the engine opens itself. The prompt encoding follows
config.json's model_type: V4.1 checkpoints take DeepseekV41Encoding, V4 ones DeepseekV4Encoding.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

import deepseek_recipe as dr

from kvcache.engine.async_engine import AsyncEngine
from kvcache.engine.config import CacheConfig, EngineConfig
from kvcache.engine.llm_engine import LLMEngine
from kvcache.engine.sampling import SamplingParams
from kvcache.server.model_api.errors import ApiError

log = logging.getLogger("kvcache.server.model_api")

DEFAULT_DEMO = "v41-small"


@dataclass(frozen=True)
class Family:
    """What a checkpoint's model_type means to the recipe."""
    encoding: type
    version: Any                  # dr.ModelVersion
    official_name: str


FAMILIES = {"deepseek_v41": Family(dr.DeepseekV41Encoding, dr.ModelVersion.DeepseekV41Flash, "DeepSeek-V4.1-Flash"),
            "deepseek_v4": Family(dr.DeepseekV4Encoding, dr.ModelVersion.DeepseekV4Pro, "DeepSeek-V4-Pro")}


@dataclass
class ModelHost:
    engine: AsyncEngine
    tokenizer: Any                # engine/tokenizer.py's Tokenizer (text prompts of /v1/completions)
    recipe_tokenizer: Any         # dr.Tokenizer over the same tokenizer.json (the StreamProcessor decodes with it)
    encoding: Any                 # dr.DeepseekV41Encoding | dr.DeepseekV4Encoding, with the tokenizer
    options: Any                  # dr.ConversionOptions: the served names as aliases of the model's version
    served_model_name: str
    model_names: frozenset[str]   # what a request's `model` may say
    context_limit: int            # prompt + completion tokens one request may have
    vocab_size: int
    assistant_token: int | None = None   # the id of <｜Assistant｜>: where a chat prompt's cache point goes
    think_token: int | None = None       # the id of <think>: a prompt ending in it is in thinking mode
    ready: bool = False

    @property
    def grammars(self):
        """The engine's GrammarCompiler (engine/structured/compiler.py; None without a tokenizer)."""
        return self.engine.engine.grammars

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise ApiError(404, f"the model {str(name)[:100]!r} does not exist; this server serves "
                           f"{self.served_model_name!r}", param="model", code="model_not_found")

    def running_waiting(self) -> tuple[int, int]:
        """The engine's running and waiting requests (read from the server's thread: list lengths)."""
        scheduler = self.engine.engine.scheduler
        return len(scheduler.running), len(scheduler.waiting)

    def close(self) -> None:
        """Stop the engine's thread, then wait for its cache's pending saves (before the store closes)."""
        self.ready = False
        self.engine.close()
        self.engine.engine.close()


def engine_config(sections: Mapping[str, Any], cache_url: str | None = None,
                  cache_mode: str | None = None) -> EngineConfig:
    """The engine's settings from a config file's [engine] and [cache] sections. With a model the
    cache defaults to exact mode (bit-identical reuse) unless the file has a [cache] section;
    `cache_url` (--cache) makes the engine use that cache daemon instead of the server's own
    store, and `cache_mode` (--cache-mode) overrides the mode; either turns the cache on."""
    config = EngineConfig.from_dict(sections)
    if "cache" not in sections:
        config = dataclasses.replace(config, cache=CacheConfig(mode="exact"))
    flags = {k: v for k, v in (("store", cache_url), ("mode", cache_mode)) if v}
    if flags:
        cache = config.cache or CacheConfig(mode="exact")
        config = dataclasses.replace(config, cache=dataclasses.replace(cache, **flags))
    return config


def _demo_name(spec: str) -> str | None:
    """NAME for "demo:NAME" (the default demo for "demo"), None for a checkpoint directory."""
    if spec != "demo" and not spec.startswith("demo:"):
        return None
    return spec.partition(":")[2] or DEFAULT_DEMO


def check_model_spec(spec: str, served_model_name: str | None = None) -> str:
    """The name the model will be served as, once --model is checked as far as it can be before
    loading (a checkpoint directory with a config.json, a demo config that exists), so that a
    mistyped --model fails at start rather than after the port opened."""
    name = _demo_name(spec)
    if name is not None:
        from kvcache.engine.checkpoint.demo import config_path
        config_path(name)                                   # FileNotFoundError naming the demo configs
    elif not os.path.isfile(os.path.join(spec, "config.json")):
        raise FileNotFoundError(f"--model {spec}: no config.json there (give a checkpoint directory, or "
                                "demo / demo:NAME for a demo checkpoint)")
    return served_model_name or name or os.path.basename(os.path.normpath(spec))


def checkpoint_dir(spec: str, data_dir: str) -> str:
    """DIR, or for "demo" / "demo:NAME" the demo checkpoint under data_dir/models (built on first
    use, under a lock: servers starting together on one data directory build it once)."""
    name = _demo_name(spec)
    if name is None:
        check_model_spec(spec)
        return spec
    from kvcache.engine.checkpoint.demo import demo_checkpoint
    models = os.path.join(data_dir, "models")
    os.makedirs(models, exist_ok=True)
    with open(os.path.join(models, f".{name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                   # released when the file closes
        if not os.path.isfile(os.path.join(models, name, "config.json")):
            log.warning("building the demo checkpoint %s under %s (once)", name, models)
        return demo_checkpoint(models, name)


def open_model_host(spec: str, data_dir: str, config: EngineConfig, store=None, served_model_name: str | None = None,
                    device: str = "cpu") -> ModelHost:
    """Load, build the engine, warm it up. `store`: the daemon's BlockStore (None: the engine opens
    config.cache.store itself, or has no store)."""
    from kvcache.engine.llm import load_checkpoint
    path = checkpoint_dir(spec, data_dir)
    model, tokenizer = load_checkpoint(path, device)
    if tokenizer is None:
        raise FileNotFoundError(f"{path} has no tokenizer.json: the model routes need one")
    family = FAMILIES.get(model.config.model_type)
    if family is None:
        raise ValueError(f"{path}: model_type {model.config.model_type!r} has no prompt encoding here; "
                         f"known: {sorted(FAMILIES)}")
    engine = LLMEngine(model, tokenizer, config, store=store)
    try:
        warm_up(engine)
    except BaseException:
        engine.close()
        raise
    name = check_model_spec(spec, served_model_name)
    recipe_tokenizer = dr.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    options = dr.ConversionOptions().with_model_versions_by_name({name: family.version,
                                                                  family.official_name: family.version})
    encoding = family.encoding().with_tokenizer(recipe_tokenizer)
    host = ModelHost(AsyncEngine(engine), tokenizer, recipe_tokenizer, encoding, options, name,
                     frozenset((name, family.official_name)), context_limit(engine), model.config.vocab_size,
                     special_token_id(recipe_tokenizer, options, dr.SpecialToken.Assistant),
                     special_token_id(recipe_tokenizer, options, dr.SpecialToken.ThinkingStart))
    host.ready = True
    return host


def special_token_id(recipe_tokenizer, options, token) -> int | None:
    """The one id a special token encodes to (None where the tokenizer lacks it)."""
    ids = recipe_tokenizer.encode(options.special_tokens.token(token))
    return ids[0] if len(ids) == 1 else None


def context_limit(engine: LLMEngine) -> int:
    """The tokens one request may hold: the model's positions, and what the whole pool holds."""
    pool = engine.config.num_blocks * engine.config.block_size - engine.scheduler.lookahead
    return min(engine.model.config.max_position_embeddings, pool)


def warm_up(engine: LLMEngine) -> None:
    """One tiny request through every phase (prefill, decode, sampling) before the first client's."""
    req = engine.add_request([engine.model.config.bos_token_id or 0], SamplingParams(max_tokens=2, temperature=0,
                                                                                   ignore_eos=True),
                             request_id="warm-up")
    while engine.has_work():
        engine.step()
    engine.forget(req.request_id)
