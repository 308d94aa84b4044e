"""`KVCacheConnector`: vLLM's KV connector over a kvcache store (`kvcache serve`, or a directory).

vLLM makes one per role: in its scheduler (lookups and the per-step plan: scheduler_side.py)
and in each worker (copies between its KV tensors and the store: worker_side.py). Both reach
the store through the engine's own seam (`engine/cache/connector.py`: a store that fails or is
down is a miss, warned once and probed again later; saves bounded and dropped, counted, beyond
`max_pending_save_bytes`). Settings: settings.py; names and keys: naming.py; docs/vllm.md has
the command lines.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcache.client.open_store import open_store
from kvcache.engine.cache.connector import KVConnector as StoreSeam
from kvcache.engine.config import CacheConfig
from kvcache.integrations.vllm.kv_blocks import KVBlocks
from kvcache.integrations.vllm.metadata import KVCacheMetadata
from kvcache.integrations.vllm.naming import BlockNaming, ParallelLayout
from kvcache.integrations.vllm.scheduler_side import SchedulerSide
from kvcache.integrations.settings import ConnectorSettings
from kvcache.integrations.vllm.worker_side import WorkerSide

log = logging.getLogger(__name__)
# How long a step that computes nothing waits for a pending load. Each idle step vLLM runs is
# Python holding the GIL the loader thread needs: 5 ms here left a 128 MiB load at ~0.65 of the
# daemon's own read rate, 20 ms at ~1. The cost: a request arriving while vLLM only waits on
# loads is scheduled up to this much later (a wait ends as soon as a load finishes).
IDLE_WAIT_S = 0.020
CLIENT_NAME = "vllm"           # how the daemon's metrics and reports label this traffic


def device_label() -> str:
    """What decides how a block's bytes are laid out on this host, beyond dtype and shape."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"cuda-sm{major}{minor}"
    isa = torch.backends.cpu.get_cpu_capability().lower()
    amx = getattr(torch._C._cpu, "_is_amx_tile_supported", lambda: False)()
    return f"cpu-{isa}{'-amx' if amx else ''}"


def block_naming(vllm_config, settings: ConnectorSettings) -> BlockNaming:
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    dtype = mc.dtype if cc.cache_dtype == "auto" else cc.cache_dtype
    model = settings.model_id or f"vllm:{mc.model}@{mc.revision or 'main'}"
    return BlockNaming(model=model, dtype=str(dtype).removeprefix("torch."), kv_heads=mc.get_num_kv_heads(pc),
                       head_size=mc.get_head_size(), block_size=cc.block_size, backend=_backend_name(vllm_config),
                       device=device_label(),
                       parallel=ParallelLayout(pc.tensor_parallel_size, pc.pipeline_parallel_size),
                       tenant_salt=settings.tenant_salt, name=settings.namespace_name)


def _backend_name(vllm_config) -> str:
    """The attention backend as configured ("auto" unless set), the KV cache layout vLLM uses
    (NHD, HND: the same bytes in another order) and vLLM's version (a release may pack a block
    differently): blocks of another combination live in another namespace."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    try:
        layout = get_kv_connector_cache_layout(vllm_config)
    except Exception:           # an older vLLM without it
        layout = "NHD"
    return f"{getattr(backend, 'name', backend) or 'auto'}/{layout}/vllm-{vllm.__version__}"


def _seam(settings: ConnectorSettings, namespace, layout=(), retries: int = 3) -> StoreSeam:
    """The store seam over the daemon. Only a daemon: vLLM's scheduler and each worker open the
    store, and a data directory takes one process's lock. `retries`: the scheduler's lookups run
    on vLLM's scheduling path, so a daemon that hangs costs them one timeout, not four."""
    spec = settings.store_spec
    if not spec.startswith(("http://", "https://", "unix://")):
        raise ValueError(f"kv_connector_extra_config['store'] = {spec!r}: vLLM's scheduler and workers each "
                         "open the store, so it must be a `kvcache serve` daemon (http://host:port or "
                         "unix:///path.sock), not a data directory")
    store = open_store(spec, token=settings.bearer, timeout_s=settings.timeout_s, retries=retries,
                       client_name=CLIENT_NAME)
    config = CacheConfig(store=spec, max_pending_save_bytes=settings.max_pending_save_bytes)
    return StoreSeam(store, namespace, layout, config, retry_s=settings.retry_s, refusal_is_miss=True)


class KVCacheConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save dropped by a preemption is a later miss, never lost output."""
        return False

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        self.naming = block_naming(vllm_config, self.settings)
        self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # a block that fails to load is a miss, never a failed request (vLLM's default fails
            # it); vLLM's scheduler reads this after making its connector
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                log.info("kvcache connector: kv_load_failure_policy set to recompute (a failed load is a miss)")
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            seam = _seam(self.settings, self.naming.namespace(0, 0), retries=0)
            self.scheduler = SchedulerSide(seam, self.naming, load=self.settings.load, save=self.settings.save,
                                           block_ids_of=self._block_ids_of)
        log.info("kvcache connector (%s) on %s, namespace layout %s", role.name.lower(), self.settings.store_spec,
                 self.naming.layout(0, 0))

    def _block_ids_of(self, req_id: str) -> list[int]:
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
        num_blocks = self._num_blocks or next(iter(kv_caches.values())).shape[0]
        blocks = KVBlocks(kv_caches, num_blocks)
        seam = _seam(self.settings, self.naming.namespace(tp_rank, pp_rank), blocks.layout)
        self.worker = WorkerSide(seam, blocks, self.naming.parallel.rank(tp_rank, pp_rank),
                                 load_timeout_s=self.settings.load_timeout_s)
        log.info("kvcache connector: %d KV tensors, %d blocks of %d bytes (all layers) on rank tp%d/pp%d",
                 len(kv_caches), num_blocks, blocks.payload_bytes, tp_rank, pp_rank)

    def _meta(self) -> KVCacheMetadata | None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return meta if isinstance(meta, KVCacheMetadata) and self.worker is not None else None

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if isinstance(kv_connector_metadata, KVCacheMetadata) and kv_connector_metadata.preempted and self.worker:
            self.worker.wait_copies()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is not None:
            self.worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return          # loads are asynchronous, whole requests: vLLM schedules a request once loaded

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return          # blocks are saved whole (every layer) once the step's forward ran: wait_for_save

    def wait_for_save(self):
        meta = self._meta()
        if meta is not None:
            self.worker.start_saves(meta)

    def get_finished(self, finished_req_ids: set[str]):
        if self.worker is None:
            return None, None
        meta = self._meta()
        if meta is not None and meta.idle:     # vLLM is only waiting: let the load threads run
            self.worker.wait_loads(IDLE_WAIT_S)
        return self.worker.finished(finished_req_ids, meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_errors() if self.worker is not None else set()

    def shutdown(self):
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.seam.close()
            self.scheduler.seam.store.close()

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.scheduler.after_alloc(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVCacheMetadata:
        return self.scheduler.build(scheduler_output)

    def update_connector_output(self, connector_output):
        self.scheduler.loaded(connector_output.finished_recving, getattr(connector_output, "invalid_block_ids", ()))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request, list(block_ids)), None

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        """Claimed tokens split by the store tier they come from: DRAM is host memory, NVMe and
        object storage are disk."""
        split = self.scheduler.claimed_tiers(request.request_id, num_external_tokens)
        out: dict = {}
        for tier, tokens in split.items():
            src = CacheHitSource.HOST if tier == "dram" else CacheHitSource.DISK
            out[src] = out.get(src, 0) + tokens
        return out
