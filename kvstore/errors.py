"""The store's exceptions. Each message says what went wrong and what to do."""


class StoreError(Exception):
    """Base class: anything the store refuses or cannot do."""


class BlockFormatError(StoreError, ValueError):
    """A payload or layout that does not describe a valid block (caller's mistake)."""


class BufferTooSmallError(ValueError):
    """An output buffer smaller than the block read into it (caller's mistake; nothing copied)."""


class CorruptBlockError(StoreError):
    """Stored bytes failed verification. Never surfaces from a read: reads turn it into a miss."""


class UnknownNamespaceError(StoreError, KeyError):
    """A namespace id the store has never registered."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown namespace"


class TierFullError(StoreError):
    """A tier cannot make room (everything left is pinned, or the disk is full)."""


class StoreUnavailableError(StoreError):
    """The store did not answer (a daemon that is not running, a connection refused, reset or
    timed out). Nothing was refused: the same call may succeed later. A cache reader treats it
    as a miss and tries the store again after a while (engine/cache/connector.py)."""


class StoreLockedError(StoreError):
    """Another process holds the data directory open for writing."""


class NamespaceLimitError(StoreError):
    """A new namespace past the number one tenant may register (the daemon's
    server.max_namespaces_per_tenant)."""
