"""nezha_hf.safe_output: destinations checked first, outputs renamed into place only when complete."""

import pytest

from nezha_hf.safe_output import (
    check_destination,
    staged_file,
    staged_files_into,
    staged_folder,
)


def test_a_failed_write_leaves_the_old_folder_as_it_was(tmp_path):
    old = tmp_path / "model"
    old.mkdir()
    (old / "config.json").write_text("old")
    with pytest.raises(RuntimeError), staged_folder(old) as staging:
        (staging / "config.json").write_text("new")
        raise RuntimeError("verification failed")
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and (old / "config.json").read_text() == "old"
    with pytest.raises(FileExistsError, match="--overwrite"), staged_folder(old) as staging:
        (staging / "model.safetensors").write_text("new")
    assert (old / "config.json").read_text() == "old"
    with staged_folder(old, overwrite=True) as staging:
        (staging / "model.safetensors").write_text("new")
    assert sorted(p.name for p in old.iterdir()) == ["model.safetensors"]  # replaced whole
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_files_move_in_beside_what_the_folder_already_holds(tmp_path):
    folder = tmp_path / "run"
    (folder / "checkpoint-10").mkdir(parents=True)
    (folder / "model-00001-of-00002.safetensors").write_text("old shard")
    with staged_files_into(folder) as staging:
        (staging / "model.safetensors").write_text("new")
        (staging / "config.json").write_text("{}")
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint-10", "config.json", "model.safetensors"]
    with pytest.raises(KeyError), staged_files_into(folder) as staging:
        (staging / "config.json").write_text("half")
        raise KeyError("interrupted")
    assert (folder / "config.json").read_text() == "{}" and [p.name for p in tmp_path.iterdir()] == ["run"]


def test_destinations_that_would_lose_data_are_refused(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "weights").write_text("x")
    for destination in (source, source / "inside", tmp_path):
        with pytest.raises(ValueError, match="never written"):
            check_destination(destination, [source])
    full = tmp_path / "full"
    full.mkdir()
    (full / "a").write_text("a")
    with pytest.raises(FileExistsError, match="overwrite"):
        check_destination(full)
    assert check_destination(full, overwrite=True) == full
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_destination(tmp_path / "missing" / "out.jsonl", kind="file")
    with pytest.raises(IsADirectoryError):
        check_destination(full, kind="file")
    with staged_file(tmp_path / "out.json") as staging:
        staging.write_text("done")
    assert (tmp_path / "out.json").read_text() == "done"


def test_a_full_disk_or_a_read_only_folder_names_the_destination(tmp_path, monkeypatch):
    """Issue 54 (kept back): a full disk's error ("[Errno 28] No space left on device") named no output, and a
    read-only destination was reported as the lock file beside it that could not be made."""
    import errno
    import pathlib

    from filelock import UnixFileLock

    from nezha_hf.safe_output import write_text_atomically

    destination = tmp_path / "summaries.jsonl"
    real_write_text = pathlib.Path.write_text

    def full_disk(self, *args, **kwargs):
        if self.name.startswith(f".{destination.name}.partial"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_text(self, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(pathlib.Path, "write_text", full_disk)
        with pytest.raises(OSError, match=f"{destination}.*No space left on device") as failed:
            write_text_atomically(destination, "x")
        assert failed.value.errno == errno.ENOSPC
        with pytest.raises(OSError, match=f"{tmp_path / 'model'}.*No space left on device"), \
                staged_folder(tmp_path / "model") as staging:
            (staging / "config.json").write_text("{}")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    def read_only(self, *args, **kwargs):
        raise PermissionError(errno.EROFS, "Read-only file system", self.lock_file)

    monkeypatch.setattr(UnixFileLock, "_acquire", read_only)
    with pytest.raises(OSError) as refused:
        write_text_atomically(destination, "x")
    message = str(refused.value)
    assert str(destination) in message and ".lock" not in message and "Read-only file system" in message, message
