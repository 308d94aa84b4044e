"""What the scheduler tells the workers each step: blocks to load and blocks to save.

vLLM serialises it to every worker (msgpack or pickle between processes), so it holds plain
lists. Each transfer names its blocks once and their keys per rank (naming.ParallelLayout.rank):
a worker moves the blocks under its own rank's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class Transfer:
    req_id: str
    block_ids: list[int]            # vLLM's block ids, in prompt order
    keys: list[list[bytes]]         # keys[rank][i]: the store key of block_ids[i] on that rank


@dataclass
class KVCacheMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    preempted: bool = False         # blocks go back to the pool this step: finish copying out first
    holds: list[str] = field(default_factory=list)   # finished requests whose blocks vLLM holds for us
    idle: bool = False              # the step computes nothing: vLLM is only waiting (for loads, say)
