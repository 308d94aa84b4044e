"""What a vLLM block is called in the store: its namespace per parallel rank, and its block keys.

vLLM's own block hashes are not used: without PYTHONHASHSEED their chain starts from a random
seed per process, so two processes (or one after a restart) would never agree. The keys are the
store's chained hash over the request's token ids (`kvstore/hashing.py`), from a root that
carries everything else the KV depends on:

    namespace (one per rank)                           chain root
    ───────────────────────────────────────────        ─────────────────────────────────
    model_fingerprint  vllm:<model>@<revision>         salted_root(ns, cache_salt + lora)
                       (or the `model_id` setting)
    kv_layout          vllm1;<dtype>;<kv heads per rank>x<head size>;<attention backend>;
                       <device: cpu ISA or GPU arch>;tp<rank>/<size>;pp<rank>/<size>
    block_size         vLLM's block size
    tenant_salt        the `tenant_salt` setting

Inside a block vLLM's CPU attention packs K in an order that depends on the ISA it picked, so
blocks are copied whole and the ISA is part of the layout: a store shared by an AVX-512 and an
AVX2 host keeps their blocks apart rather than serving one's bytes to the other. The scheduler
knows every rank's namespace (it looks up rank 0's and names the keys each rank moves); a worker
knows only its own rank. Each record also carries its payload's layout (a tensor per layer), and
a payload of another size than this deployment's blocks is a load error, never copied in.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.kvstore.hashing import Namespace, hash_blocks, salted_root


@dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    pp_size: int = 1

    @property
    def ranks(self) -> int:
        return self.tp_size * self.pp_size

    def rank(self, tp_rank: int, pp_rank: int) -> int:
        """The index of (tp_rank, pp_rank) among `ranks`: the position of its keys in a transfer."""
        return pp_rank * self.tp_size + tp_rank


@dataclass(frozen=True)
class BlockNaming:
    """The store's view of one vLLM deployment: the settings every rank shares."""

    model: str                # model fingerprint
    dtype: str                # the KV cache's dtype, as torch names it ("float32", "bfloat16", ...)
    kv_heads: int             # KV heads per rank
    head_size: int
    block_size: int
    backend: str              # the attention backend's name
    device: str               # "cpu-avx512", "cuda-sm90", ...
    parallel: ParallelLayout = ParallelLayout()
    tenant_salt: str = ""
    name: str = ""            # the namespace's label (retention rules are keyed by it)

    def layout(self, tp_rank: int, pp_rank: int) -> str:
        p = self.parallel
        return (f"vllm1;{self.dtype};{self.kv_heads}x{self.head_size};{self.backend};{self.device};"
                f"tp{tp_rank}/{p.tp_size};pp{pp_rank}/{p.pp_size}")

    def namespace(self, tp_rank: int, pp_rank: int) -> Namespace:
        return Namespace(model_fingerprint=self.model, kv_layout=self.layout(tp_rank, pp_rank),
                         block_size=self.block_size, tenant_salt=self.tenant_salt, name=self.name)

    def namespaces(self) -> list[Namespace]:
        """Every rank's namespace, in rank order (ParallelLayout.rank)."""
        p = self.parallel
        return [self.namespace(tp, pp) for pp in range(p.pp_size) for tp in range(p.tp_size)]


def request_salt(cache_salt: str | None, lora_name: str | None) -> str:
    """The chain's salt: a request's cache_salt, and its LoRA adapter (another adapter, other KV)."""
    salt = cache_salt or ""
    return f"{salt}\x00lora:{lora_name}" if lora_name else salt


class KeyChain:
    """One request's block keys in every rank's namespace, extended as its tokens become blocks.

    Hashing is incremental: each call hashes only the blocks not hashed yet, from the last key."""

    def __init__(self, namespaces: list[Namespace], salt: str):
        self._namespaces = namespaces
        self.keys: list[list[bytes]] = [[] for _ in namespaces]
        self._roots = [salted_root(ns, salt) for ns in namespaces]

    def __len__(self) -> int:
        return len(self.keys[0])

    def extend(self, token_ids, num_blocks: int) -> None:
        """Hash blocks up to `num_blocks` from `token_ids` (the request's tokens from the start)."""
        have = len(self)
        if num_blocks <= have:
            return
        bs = self._namespaces[0].block_size
        new = list(token_ids[have * bs: num_blocks * bs])
        for r, ns in enumerate(self._namespaces):
            parent = self.keys[r][-1] if have else self._roots[r]
            self.keys[r].extend(hash_blocks(ns, new, parent=parent))

    def slice(self, start: int, stop: int) -> list[list[bytes]]:
        """Per rank, the keys of blocks start..stop."""
        return [k[start:stop] for k in self.keys]
