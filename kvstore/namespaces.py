"""A store's namespaces: registering one, renaming it, and a bound on how many one owner has.

    register_namespace(ns)
        id unknown                   -> registered under ns.name
        id known, ns.name "" or same -> nothing to do
        id known, another ns.name    -> renamed (a namespace's name is its owner's to change)

Every change is written namespaces.json first, then the index, then memory. A failure (a full
or read-only disk: TierFullError / StoreError) leaves memory as it was, so the next registration
tries again; at worst namespaces.json holds what the index lacks (a new namespace, or its new
name), which a rebuilt index takes from there.

Retention overrides are keyed by name (kvstore/retention.py), so a rename can change a namespace's
rule. The DRAM read directory's entries carry deadlines from the old rule; when the new rule can
end a block sooner, the entries of that namespace's blocks are withdrawn (clients take a lease
once, which publishes the new deadlines). Other namespaces' entries stay: the directory is
shared by every tenant, and one tenant's rename must not cost the others their reads.
"""

from __future__ import annotations

from kvcache.kvstore.errors import NamespaceLimitError, UnknownNamespaceError
from kvcache.kvstore.hashing import Namespace
from kvcache.kvstore.retention import RetentionRule


class StoreNamespaces:
    """BlockStore's namespace half; needs self._lock, self.namespaces, self.index, self.nvme,
    self.object, self.dram, self.config and self._best_effort."""

    def register_namespace(self, ns: Namespace) -> bytes:
        """Make `ns` known (persisted); returns its 16-byte id. Idempotent; a new non-empty name
        renames it."""
        self.save_namespace(ns)
        return ns.id

    def save_namespace(self, ns: Namespace, max_per_owner: int | None = None) -> Namespace | None:
        """register_namespace that answers the registration `ns` replaced (None: it is new).
        With `max_per_owner`, a new namespace past that many of its owner's is refused
        (NamespaceLimitError) and nothing is written."""
        with self._lock:
            before = self.namespaces.get(ns.id)
            if before is not None and (not ns.name or ns.name == before.name):
                return before
            if before is None and max_per_owner is not None:
                _check_room(self.namespaces.values(), ns.owner, max_per_owner)
            self._persist_namespace(ns)
            if (before is not None and self.dram is not None
                    and _ends_sooner(self._rule_of(ns), self._rule_of(before))):
                self.dram.unpublish_namespace(ns.id)
            return before

    def _persist_namespace(self, ns: Namespace) -> None:
        known = {**self.namespaces, ns.id: ns}
        descriptors = {k.hex(): v.to_dict() for k, v in known.items()}
        if self.nvme is not None:
            self.nvme.save_namespaces(descriptors)
        self.index.add_namespace(ns)          # a put: a rename overwrites the descriptor
        self.namespaces[ns.id] = ns
        if self.object is not None:
            self._best_effort(self.object.save_namespaces, descriptors)

    def _rule_of(self, ns: Namespace):
        # the name's own rule, whatever tenant overrides say: a block's tenant may not be the owner
        return self.config.retention.rule(ns.name, "")

    def _namespace(self, namespace_id: bytes) -> Namespace:
        ns = self.namespaces.get(namespace_id)
        if ns is None:
            raise UnknownNamespaceError(f"namespace {namespace_id.hex()} is not registered with this store; "
                                        "call register_namespace() first")
        return ns


def _ends_sooner(new: RetentionRule, old: RetentionRule) -> bool:
    """Whether `new` can expire some block before `old` did: only then can a published deadline
    outlive the block (a longer rule keeps every deadline safe, merely early)."""
    if new.ttl_s < old.ttl_s:
        return True
    return new.max_age_s is not None and (old.max_age_s is None or new.max_age_s < old.max_age_s)


def _check_room(registered, owner: str, limit: int) -> None:
    if sum(1 for n in registered if n.owner == owner) >= limit:
        raise NamespaceLimitError(
            f"tenant {owner!r} has registered {limit} namespaces, the most this store allows: reuse one "
            "(registering it under a new name renames it) or ask an admin to raise "
            "server.max_namespaces_per_tenant")
