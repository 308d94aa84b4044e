"""The fsync helpers the store's files share: what each syncs, and that failures are raised
(the caller decides whether durability is best effort)."""

import os

import pytest

from kvcache.kvstore import durable


def _synced_paths(monkeypatch) -> list[str]:
    seen, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (seen.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    return seen


def test_replace_synced_syncs_the_new_file_before_the_rename_and_then_the_directory(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("old")
    (tmp_path / "f.tmp").write_text("new")
    seen = _synced_paths(monkeypatch)
    durable.replace_synced(str(tmp_path / "f.tmp"), str(tmp_path / "f"), sync_dir=True)
    assert (tmp_path / "f").read_text() == "new" and not (tmp_path / "f.tmp").exists()
    assert seen == [str(tmp_path / "f.tmp"), str(tmp_path)]     # the file under its old name: before the rename


def test_without_sync_dir_only_the_file_is_synced(tmp_path, monkeypatch):
    (tmp_path / "f.tmp").write_text("new")
    seen = _synced_paths(monkeypatch)
    durable.replace_synced(str(tmp_path / "f.tmp"), str(tmp_path / "f"))
    assert seen == [str(tmp_path / "f.tmp")]


def test_failures_are_raised_and_leave_the_old_file(tmp_path):
    (tmp_path / "f").write_text("old")
    with pytest.raises(FileNotFoundError):
        durable.replace_synced(str(tmp_path / "missing.tmp"), str(tmp_path / "f"), sync_dir=True)
    assert (tmp_path / "f").read_text() == "old"
    with pytest.raises(FileNotFoundError):
        durable.fsync_dir(str(tmp_path / "no-such-dir"))
