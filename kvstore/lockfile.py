"""One writer process per data directory: a second one gets a clear error, not corruption."""

from __future__ import annotations

import fcntl
import os

from kvcache.kvstore.errors import StoreError, StoreLockedError


def lock_data_dir(data_dir: str):
    """An open file holding an exclusive flock on DATA_DIR/LOCK (close it to release)."""
    try:
        os.makedirs(data_dir, exist_ok=True)
        f = open(os.path.join(data_dir, "LOCK"), "a+")
    except OSError as e:
        raise StoreError(f"cannot use data directory {data_dir}: {e.strerror}; "
                         "create it or choose a writable path") from e
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise StoreLockedError(f"data directory {data_dir} is in use by {holder}; stop that process "
                               "first (read-only commands such as `kvcache stats` work meanwhile)") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f


def lock_holder(data_dir: str) -> str | None:
    """Who holds DATA_DIR's lock ("pid 1234"), or None when nobody does. Takes the lock shared
    for an instant, so it never blocks and never disturbs the holder."""
    try:
        f = open(os.path.join(data_dir, "LOCK"))
    except OSError:
        return None                  # no lock file: no store has ever run here
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "another process"
        fcntl.flock(f, fcntl.LOCK_UN)
        return None
