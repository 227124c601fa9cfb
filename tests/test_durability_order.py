"""Retention deletes an old step only once the new step is durable.

Orbax's `Checkpointer`, given a preservation policy, deletes old steps while it finalizes a save:
after renaming the new step into place but before keras-orbax has fsynced Orbax's metadata files
and that rename. A power loss in between could leave `max_to_keep=1` with nothing to resume from.
These tests record, in a real `fit`, every fsync, rename and deletion made in the checkpoint
directory (`tests/_fs_journal.py`: the real calls, wrapped) and check the order.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.format import step_dirs
from tests import _fs_journal


def _fit(directory, *, background: bool, epochs: int = 3) -> None:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense")])
    model.compile(optimizer="adam", loss="mse")
    x = np.arange(64, dtype="float32").reshape(16, 4) / 64
    y = np.ones((16, 3), "float32")
    checkpoint = keras_orbax.ModelCheckpoint(
        directory, max_to_keep=1, save_on_background=background
    )
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, callbacks=[checkpoint], verbose=0)


@pytest.mark.parametrize("background", [True, False], ids=["background", "blocking"])
def test_the_new_step_is_durable_before_the_old_one_is_deleted(tmp_path, monkeypatch, background):
    root = tmp_path / "ckpt"
    journal = _fs_journal.record(monkeypatch, root)
    _fit(root, background=background)

    assert step_dirs.committed_steps(root) == [6]  # 2 batches per epoch; steps 2 and 4 deleted
    deletions = journal.deletions()
    assert [(d.step, d.newest) for d in deletions] == [(2, 4), (4, 6)]
    for deletion in deletions:
        new = root / str(deletion.newest)
        fsynced = journal.fsynced_before(deletion.index)
        # Every file and directory of the new step: shards, Orbax's _CHECKPOINT_METADATA,
        # _METADATA, _sharding, commit markers, the metrics, and each directory holding them.
        assert len(deletion.held) > 20
        unsynced = sorted(path for inode, path in deletion.held.items() if inode not in fsynced)
        assert unsynced == [], f"not fsynced before step {deletion.step} was deleted"
        # The rename into place is durable: the step's directory and the one holding it (whose
        # entry the rename changed) are fsynced after it, before the deletion.
        renamed = journal.index("rename", new)
        assert renamed is not None and renamed < deletion.index
        for directory in (new, root):
            synced = journal.index("fsync", directory, after=renamed)
            assert synced is not None and synced < deletion.index, directory
