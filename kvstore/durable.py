"""Making files and directory entries durable: the fsyncs the store's files share.

    fsync_file(path)          the file's data and metadata on disk (opened, fsynced, closed)
    fsync_dir(directory)      the directory's entries: files created, renamed or unlinked in it
    replace_synced(tmp, path) fsync tmp, then rename it over path: a reader, or a crash, sees
                              the old file or the whole new one, never a part; with
                              sync_dir, the rename itself survives a crash too

Each raises OSError; a caller for whom durability is best effort catches it.
"""

from __future__ import annotations

import os


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    fsync_file(directory)     # a directory opens O_RDONLY like a file, and fsync takes its fd


def replace_synced(tmp: str, path: str, *, sync_dir: bool = False) -> None:
    fsync_file(tmp)
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(os.path.dirname(path) or ".")
