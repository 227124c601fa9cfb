"""The commit protocol every export goes through (`storage/commit.py`), beyond the fault matrix."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import keras_hub
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.storage import commit
from keras_orbax.errors import KerasOrbaxWarning, SaveFailedError
from tests import _faults


class _OneFile(commit.ExportSink):
    """A sink of one file whose regions are `a` and `b`; it writes those given."""

    whole_directory = False

    def __init__(self, destination: Path, writes: list[str]) -> None:
        self.destination, self.writes = destination, writes

    def prepare(self, staging: Path) -> None:
        pass

    def stage(self, staging: Path) -> list[str]:
        (staging / self.destination.name).write_text(",".join(self.writes))
        return self.writes

    def regions_due(self, process: int) -> list[str]:
        return ["a", "b"]

    def assemble(self, staging: Path) -> None:
        pass

    def commit_order(self) -> list[str]:
        return [self.destination.name]

    def replaced(self) -> list[str]:
        return []

    def is_export_file(self, relative: str) -> bool:
        return True


def test_a_region_not_written_fails_the_export(tmp_path):
    """Completeness is checked against the regions due, not what the staging directory holds."""
    destination = tmp_path / "out.txt"
    commit.write(_OneFile(destination, ["a", "b"]), "whole")
    with pytest.raises(SaveFailedError, match=r"Not every region.*wrote 1 regions, was due 2"):
        commit.write(_OneFile(destination, ["a"]), "partial")
    assert destination.read_text() == "a,b"  # the previous export
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]  # nothing staged left


def test_a_directory_export_keeps_other_files_and_drops_stale_weights(tmp_path):
    """A preset exported in the sharded form, then as one file: the user's README and the
    preprocessor-less task load; no part of the earlier form is left to shadow the new weights."""
    model = _faults.build("preset")
    _faults.fill(model, _faults.PREVIOUS)
    keras_orbax.save_to_preset(model, tmp_path / "preset", max_shard_size=1e-6)
    assert (tmp_path / "preset" / "model.weights.json").exists()
    (tmp_path / "preset" / "README.md").write_text("mine")
    (tmp_path / "preset" / "notes").mkdir()
    (tmp_path / "preset" / "notes" / "a.txt").write_text("kept")
    want = _faults.fill(model, _faults.NEW)
    keras_orbax.save_to_preset(model, tmp_path / "preset")
    names = sorted(
        p.relative_to(tmp_path / "preset").as_posix() for p in (tmp_path / "preset").rglob("*")
    )
    assert "README.md" in names and "notes/a.txt" in names
    assert (tmp_path / "preset" / "README.md").read_text() == "mine"
    assert not [n for n in names if n.startswith("model_") or n == "model.weights.json"], names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preset"]
    loaded = keras_hub.models.TextClassifier.from_preset(str(tmp_path / "preset"))
    for i, weight in enumerate(loaded.weights):
        np.testing.assert_array_equal(np.asarray(weight.value), want[i])


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_directory_export_to_a_mount_point_renames_its_files(tmp_path):
    """A mount point cannot be swapped: the export is staged inside it and renamed file by file,
    with a warning; the new export loads, and the old form's weights are gone."""
    model = _faults.build("preset")
    with _faults.tmpfs(tmp_path / "preset") as mounted:
        _faults.fill(model, _faults.PREVIOUS)
        with pytest.warns(KerasOrbaxWarning, match="cannot be swapped"):
            keras_orbax.save_to_preset(model, mounted, max_shard_size=1e-6)
        want = _faults.fill(model, _faults.NEW)
        with pytest.warns(KerasOrbaxWarning, match="renamed one by one, configs last"):
            keras_orbax.save_to_preset(model, mounted)
        names = sorted(p.name for p in mounted.iterdir())
        assert "model.weights.h5" in names and "model.weights.json" not in names, names
        assert not [n for n in names if n.startswith((".", "model_"))], names
        loaded = keras_hub.models.TextClassifier.from_preset(str(mounted))
        for i, weight in enumerate(loaded.weights):
            np.testing.assert_array_equal(np.asarray(weight.value), want[i])


def _shard_files(state: Path) -> list[Path]:
    """The shard files under a step's `state/` (`<array>/c/...` or a packed `<array>/c.0.0`)."""
    return [
        path
        for path in sorted(state.rglob("*"))
        if path.is_file()
        and len(parts := path.relative_to(state).parts) >= 2
        and (parts[1] == "c" or parts[1].startswith("c."))
    ]


def test_a_step_whose_shard_file_disappears_before_the_commit_is_refused(tmp_path):
    """A shard file gone between its write and the commit: the step's region check (against the
    files each process was due to write, from the shardings) refuses it, and the previous step is
    untouched and restores exactly."""

    def remove_a_shard_file(state: Path) -> Path:
        return _shard_files(state)[-1]

    _refused_at_regions(  # kernels split over 8 devices: many shard files
        tmp_path,
        "step.fast",
        remove_a_shard_file,
        r"Not every region.*process 0: wrote \d+ regions",
    )


@pytest.mark.parametrize("removed", ["manifest.ocdbt", "a data file"])
def test_a_compact_step_whose_database_file_disappears_before_the_commit_is_refused(
    tmp_path, removed
):
    """The compact format's region check: a process due to write data must have its OCDBT
    database (`ocdbt.process_<i>/manifest.ocdbt`) and every data file it references, each looked
    up by name. One of them gone between the write and the commit: the step is refused, and the
    previous step is untouched and restores exactly."""

    def remove_a_database_file(state: Path) -> Path:
        database = state / "ocdbt.process_0"
        if removed == "manifest.ocdbt":
            return database / "manifest.ocdbt"
        return sorted((database / "d").iterdir())[0]

    match = (
        r"Not every region.*process 0: wrote 0 regions, was due 1"
        if removed == "manifest.ocdbt"
        else r"A data file of the OCDBT database .* is missing"
    )
    _refused_at_regions(tmp_path, "step.compact", remove_a_database_file, match)


def _refused_at_regions(
    tmp_path: Path, sink: str, file_to_remove: Callable[[Path], Path], match: str
) -> None:
    """Step 1 saved; step 2 saved with `file_to_remove(its staged state/)` deleted at the region
    check: `SaveFailedError` matching `match`, step 1 byte for byte as before and restoring
    exactly."""
    import keras

    from keras_orbax._src.format import step_dirs

    format = "compact" if sink == "step.compact" else "fast"
    root = tmp_path / "ckpt"
    model = _faults.built_sharded(sink)
    try:
        previous = _faults.fill(model, _faults.PREVIOUS)
        keras_orbax.save(model, root, step=1, format=format)
        before = _faults.files(root / "1")
        _faults.fill(model, _faults.NEW)
        gone = []

        def remove(stage: str) -> None:
            if stage == "regions":
                (state,) = root.glob("2.orbax-checkpoint-tmp*/state*")  # Orbax's temporary names
                path = file_to_remove(state)
                path.unlink()
                gone.append(path.name)

        with commit.on_stage(remove), pytest.raises(SaveFailedError, match=match):
            keras_orbax.save(model, root, step=2, format=format)
        assert gone  # the fault was injected where the check runs
        assert step_dirs.committed_steps(root) == [1]
        assert _faults.files(root / "1") == before
        restored = _faults.built_sharded(sink)
        keras_orbax.restore_sharded(restored, root)
        _faults.assert_values({i: w.numpy() for i, w in enumerate(restored.weights)}, previous)
    finally:
        keras.distribution.set_distribution(None)


def test_save_and_convert_resolve_the_destination_once_and_list_its_steps_once(
    tmp_path, monkeypatch
):
    """Every part of one `save` or `convert` (writer lock, step-exists check, incremental plan,
    checkpointer, durability, the error message) asks one `CheckpointRoot`: the destination is
    turned into a path once and its committed steps listed once (it was 7 and 3 for `save`, 10
    and 4 for `convert`). Counted by wrapping the two functions that do it."""
    from collections import Counter

    from keras_orbax._src.format import step_dirs
    from keras_orbax._src.storage import locations
    from tests import _models

    dest = tmp_path / "dest"
    counts: Counter[str] = Counter()
    as_path, step_dirs_of = locations.as_path, step_dirs._step_dirs

    def counted_as_path(path):
        resolved = as_path(path)
        if os.fspath(resolved) == os.fspath(dest):
            counts["resolved"] += 1
        return resolved

    def counted_step_dirs(root):
        if os.fspath(root) == os.fspath(dest):
            counts["listed"] += 1
        return step_dirs_of(root)

    model = _models.mlp()
    _faults.fill(model, _faults.PREVIOUS)
    keras_orbax.save(model, tmp_path / "src", step=1)
    keras_orbax.save(model, dest, step=1)  # a previous step: the incremental plan reads it
    monkeypatch.setattr(locations, "as_path", counted_as_path)
    monkeypatch.setattr(step_dirs, "_step_dirs", counted_step_dirs)
    keras_orbax.convert(tmp_path / "src", os.fspath(dest), step=2)  # a string: resolved here
    assert counts == {"resolved": 1, "listed": 1}
    counts.clear()
    keras_orbax.save(model, os.fspath(dest), step=3)
    assert counts == {"resolved": 1, "listed": 1}
    assert step_dirs.committed_steps(dest) == [1, 2, 3]
