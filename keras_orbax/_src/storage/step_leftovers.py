"""What a writer keeps beside a checkpoint's steps while it writes one, and putting it right once
the writer has failed or is gone.

- `<step>.orbax-checkpoint-tmp*`: Orbax's staging directory of a step being written. A failed save
  removes its own (`removing_staged`, still under the step's writer lock), so a full disk is not
  kept full for the next save. One that a killed writer left is stale once no writer holds its
  step's lock: `inspect` and `verify` report it (`notes`), and `ModelCheckpoint` removes every
  stale one of its directory when `fit` starts (`remove_stale_staged`), under its run lock.
- `.keras_orbax.<step>.replaced`: the committed step that `save(..., overwrite=True)` moved aside
  under the step's writer lock (`replacing`). It is removed only once the new step is durable; a
  failed save puts it back. If the writer was killed meanwhile, the next listing of the directory's
  steps puts it back (`put_back_replaced`), once it holds the step's lock: no writer is left.

Only process 0 moves, puts back or removes; the others wait for its decision where they must.
Object storage (`gs://`, `s3://`) is left as Orbax leaves it: it has no rename and no lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

from keras_orbax._src.compat import orbax_compat
from keras_orbax._src.runtime import quiet
from keras_orbax._src.storage import durable, locations
from keras_orbax._src.storage.writer_lock import held_if_free, is_held
from keras_orbax.errors import KerasOrbaxWarning

logger = logging.getLogger("keras_orbax")

STAGED_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's, followed by its own suffix or none
_STAGED = re.compile(r"(\d+)" + re.escape(STAGED_SUFFIX) + r".*")
_REPLACED = re.compile(r"\.keras_orbax\.(\d+)\.replaced")


def replaced_path(root: Path, step: int) -> Path:
    """Where `save(..., overwrite=True)` keeps the committed `step` until the new one is durable."""
    return root / f".keras_orbax.{step}.replaced"


def staged(root: Path) -> list[tuple[int, Path]]:
    """`(step, directory)` of each staging directory Orbax left in `root`, by step."""
    if locations.is_remote(root) or not root.is_dir():
        return []
    found = [(_STAGED.fullmatch(p.name), p) for p in root.iterdir()]
    return sorted((int(m.group(1)), p) for m, p in found if m and p.is_dir())


def replaced(root: Path) -> list[tuple[int, Path]]:
    """`(step, directory)` of each step an overwrite moved aside, by step."""
    if locations.is_remote(root) or not root.is_dir():
        return []
    found = [(_REPLACED.fullmatch(p.name), p) for p in root.iterdir()]
    return sorted((int(m.group(1)), p) for m, p in found if m and p.is_dir())


@contextlib.contextmanager
def removing_staged(root: Path, step: int) -> Iterator[None]:
    """If the block raises, process 0 removes what the save of `step` staged (call under its
    writer lock): a failed save leaves no staging directory behind."""
    from keras_orbax._src.runtime import multihost  # JAX: not on the listing's path (inspect)

    try:
        yield
    except BaseException:
        if multihost.is_primary():
            remove_staged(root, step)
        raise


def remove_staged(root: Path, step: int) -> None:
    """Removes `step`'s staging directories; a failure is logged (the save's own error is the one
    raised; `inspect` reports what is left and the next `ModelCheckpoint` removes it)."""
    for found, path in staged(root):
        if found == step:
            quiet.staging_removed(path)  # the save's late Orbax threads meet it gone
            try:
                _remove(path)
            except OSError as error:
                logger.warning("Could not remove %s after its save failed: %s", path, error)


def remove_stale_staged(root: Path) -> list[Path]:
    """Removes each staging directory in `root` whose step no writer holds the lock of (a killed
    writer's); returns them. Call holding the directory's run lock, on process 0."""
    removed = []
    for step, path in staged(root):
        with held_if_free(root, step) as free:
            if free and path.is_dir():
                _remove(path)
                removed.append(path)
    if removed:
        logger.warning(
            "Removed %d staging directories that saves killed before they committed left in "
            "'%s': %s",
            len(removed),
            root,
            ", ".join(p.name for p in removed),
        )
    return removed


@contextlib.contextmanager
def replacing(root: Path, step: int) -> Iterator[None]:
    """Moves the committed `step` aside for the block, which writes its new version (call on every
    process, under the step's writer lock, before the checkpointer lists the steps). If the block
    raises, what it staged is removed and the previous step is put back; otherwise the previous
    step is removed, once the new one is durable (when the block returns)."""
    from keras_orbax._src.runtime import multihost  # JAX: not on the listing's path (inspect)

    if locations.is_remote(root):  # no rename there: Orbax's own overwrite
        yield
        return
    moved = multihost.primary_value(f"overwrite/step {step} aside", _move_aside, root, step)
    try:
        yield
    except BaseException:
        if moved and multihost.is_primary():
            try:
                _put_back(root, step)
            except OSError as error:  # the save's own error is the one raised
                logger.warning(
                    "Could not put step %d of '%s' back after its overwrite failed: %s. It is "
                    "kept at %s; the next listing of the directory's steps puts it back.",
                    step,
                    root,
                    error,
                    replaced_path(root, step),
                )
        raise
    if moved and multihost.is_primary():
        _remove_replaced(root, step)


def _move_aside(root: Path, step: int) -> bool:
    """Renames `<step>` to its replaced name, durably; False if there is no `<step>`."""
    current, aside = root / str(step), replaced_path(root, step)
    if not current.is_dir():
        return False
    if aside.exists():  # an earlier overwrite's, its new step committed: superseded
        _remove(aside)
    os.rename(current, aside)
    durable.fsync_path(root)
    return True


def _put_back(root: Path, step: int) -> None:
    """After a failed overwrite: the new step's staging directory, and the new step if Orbax had
    renamed it already (it was never made durable), give way to the previous step."""
    remove_staged(root, step)
    current = root / str(step)
    if current.exists():
        failed = root / f".keras_orbax.{step}.failed"
        os.rename(current, failed)
        _remove(failed)
    os.rename(replaced_path(root, step), current)
    durable.fsync_path(root)


def _remove_replaced(root: Path, step: int) -> None:
    aside = replaced_path(root, step)
    try:
        _remove(aside)
        durable.fsync_path(root)
    except OSError as error:
        warnings.warn(
            f"Step {step} of '{root}' is committed and durable, but removing the version it "
            f"replaced failed: {error}. The next listing of the directory's steps removes {aside}.",
            KerasOrbaxWarning,
            stacklevel=4,
        )


def put_back_replaced(root: Path) -> None:
    """Settles each step an overwrite moved aside whose writer is gone (killed): put back where
    its step is not committed, removed where the new one is. Best effort: a directory that cannot
    be written (read-only) is left as it is, and `inspect` reports it."""
    for step, aside in replaced(root):
        with held_if_free(root, step) as free, contextlib.suppress(OSError):
            if not free or not aside.is_dir():
                continue
            current = root / str(step)
            if orbax_compat.step_metadata_file(current).is_file():
                _remove(aside)
            elif not current.exists():
                os.rename(aside, current)
                durable.fsync_path(root)


def notes(root: Path) -> tuple[str, ...]:
    """One line for each staging directory and each step moved aside in `root`: what it is, and
    whether a writer is at work on it now. Writes nothing."""
    lines = []
    for step, path in staged(root):
        if is_held(root, step):
            lines.append(f"{path.name}: step {step} being written now")
        else:
            lines.append(
                f"{path.name}: what a save of step {step} staged before it was killed (never "
                "committed, never read); the next ModelCheckpoint of this directory removes it, "
                "or remove it yourself"
            )
    for step, path in replaced(root):
        if is_held(root, step):
            lines.append(f"{path.name}: step {step} as it was, while an overwrite writes it now")
        else:
            lines.append(
                f"{path.name}: step {step} as it was before an overwrite that was killed; the "
                "next listing of the steps that may write here (a restore) puts it back"
            )
    return tuple(lines)


def _remove(path: Path) -> None:
    shutil.rmtree(path)
