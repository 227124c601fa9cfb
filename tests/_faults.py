"""The fault matrix's pieces: each export sink with its model and its oracle loader, and real faults
(a full tmpfs, an ext4 filesystem shut down so that every call on it returns EIO).

Used by `tests/test_fault_matrix.py` and its workers (`workers/fault_kill.py`,
`workers/fault_multi.py`). Faults are real: the kernel returns ENOSPC or EIO, or the process is
SIGKILLed; only the moment is chosen, by `storage.commit`'s stage hook.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import struct
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import keras
import numpy as np

SINKS = ("weights.h5", "weights.json", "preset", "transformers")
STAGES = ("stage", "agree", "fsync", "rename", "prune")
# `save`'s steps (`write.step_sink`): writing the shards ("stage"), every process's outcome agreed
# on ("agree", before Orbax's commit barrier), each process's shard files checked against those it
# was due to write ("regions"), Orbax's finalize and rename ("rename"), the renamed step made
# durable ("fsync"; after Orbax's rename). No "prune": `save` removes nothing. "step.overwrite"
# writes step 1 again (`overwrite=True`): the step it replaces must survive every failure.
STEP_SINKS = ("step.fast", "step.compact", "step.overwrite")
STEP_STAGES = ("stage", "agree", "regions", "rename", "fsync")
PREVIOUS, NEW = 0, 1  # the seeds of the previous export's values and of the failing one's


def build(sink: str) -> keras.Model:
    """The model each sink writes: a sharded MLP for Keras's files, a keras-hub text classifier
    (task weights beside a backbone's) for a preset, a Llama3 backbone for Hugging Face."""
    from tests import _hf_export, _models

    if sink.startswith(("weights", "step")):
        model = _models.mlp()
    elif sink == "preset":
        import keras_hub

        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=32,
            num_layers=1,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            max_sequence_length=8,
        )
        model = keras_hub.models.BertTextClassifier(
            backbone=backbone, num_classes=2, preprocessor=None
        )
    else:  # FFN kernels of 32 KiB: whole pages, which the matrix writes with O_DIRECT
        config = dict(_hf_export.LLAMA3, intermediate_dim=512)
        model = _hf_export.backbone_class("llama3")(**config)
    return model


def distribution_for(sink: str) -> keras.distribution.Distribution | None:
    """Shards for every sink but the preset's classifier (replicated: process 0 writes it all)."""
    from tests import _hf_export, _models

    if sink.startswith(("weights", "step")):
        return _models.model_parallel((2, 4))
    if sink == "transformers":
        return _hf_export.model_parallel("llama3")
    return None


def built_sharded(sink: str) -> keras.Model:
    """`build(sink)` under `distribution_for(sink)`, which is left set."""
    keras.distribution.set_distribution(distribution_for(sink))
    return build(sink)


def fill(model: keras.Model, seed: int) -> dict[int, np.ndarray]:
    """Gives every weight values from `seed`; returns them by position in `model.weights` (none
    where they span processes)."""
    from tests import _hf_export

    _hf_export.fill(model, seed)
    if not all(w.value.is_fully_addressable for w in model.weights):
        return {}  # under jax.distributed: no process holds them all
    return {i: np.array(w.value) for i, w in enumerate(model.weights)}


_NAMES = {
    "weights.h5": "m.weights.h5",
    "weights.json": "m.weights.json",
    "preset": "preset",
    "transformers": "hf",
    "step.fast": "ckpt",
    "step.compact": "ckpt",
    "step.overwrite": "ckpt",
}


def destination(sink: str, root: Path) -> Path:
    return root / _NAMES[sink]


def export(sink: str, model: keras.Model, root: Path) -> Path:
    import keras_orbax

    target = destination(sink, root)
    if sink == "step.overwrite":
        return keras_orbax.save(model, target, step=1, overwrite=True)
    if sink.startswith("step"):  # the next step: 1, then 2 (3 after a committed 2)
        step = 1 + sum(p.name.isdecimal() for p in target.iterdir()) if target.exists() else 1
        return keras_orbax.save(model, target, step=step, format=sink.split(".")[1])
    if sink == "weights.h5":
        return keras_orbax.save_weights(model, target)
    if sink == "weights.json":  # about 2 KiB a part: several parts
        return keras_orbax.save_weights(model, target, max_shard_size=2e-6)
    if sink == "preset":
        return keras_orbax.save_to_preset(model, target)
    return keras_orbax.export_to_transformers(model, target)


def loaded(sink: str, root: Path) -> dict[int, np.ndarray] | None:
    """What Keras's or keras-hub's own loader reads from the export in `root`, by position in the
    model's weights; None for a Hugging Face directory (its bytes are compared instead)."""
    import keras_orbax

    target = destination(sink, root)
    if sink.startswith("step"):  # the latest committed step, as `restore_sharded` picks it
        model = built_sharded(sink)
        keras_orbax.restore_sharded(model, target)
    elif sink.startswith("weights"):
        model = built_sharded(sink)
        model.load_weights(target)
    elif sink == "preset":
        import keras_hub

        keras.distribution.set_distribution(distribution_for(sink))
        model = keras_hub.models.TextClassifier.from_preset(str(target))
    else:
        return None
    return {i: np.array(w.value) for i, w in enumerate(model.weights)}


def assert_checksums_describe_the_export(sink: str, root: Path, recorded: bool = True) -> None:
    """An export's sidecar (`export_checksums`) describes the files beside it, whichever export
    they are: `verify` checks every dataset or tensor against it and finds them intact; or, where
    not `recorded`, there is none and `verify` says it checked nothing."""
    import keras_orbax

    if sink.startswith("step"):
        return
    result = keras_orbax.verify(destination(sink, root))
    if recorded:
        assert result.intact and result.checksummed > 0 and result.unchecked == (), result
    else:
        assert not result.intact and result.checksummed == 0 and result.unchecked, result
        assert "records no checksums" in result.why_unchecked, result


def kept_files(sink: str, root: Path) -> dict[str, str]:
    """`files` of what a failed export must leave as it was: the whole export, or a checkpoint's
    first step, as a reader finds it once it has listed the steps (a listing puts back a step
    that a killed overwrite had moved aside)."""
    if not sink.startswith("step"):
        return files(root)
    from keras_orbax._src.format import step_dirs

    step_dirs.committed_steps(root / "ckpt")
    return files(root / "ckpt" / "1")


def files(root: Path) -> dict[str, str]:
    """SHA-256 of every file under `root` that a reader could open: hidden names (what a failed
    export staged) and `lost+found` left out."""
    found = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if path.is_file() and not any(
            part.startswith(".") or part == "lost+found" for part in relative.parts
        ):
            found[relative.as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def assert_values(got: dict[int, np.ndarray] | None, want: dict[int, np.ndarray]) -> None:
    assert got is not None and sorted(got) == sorted(want)
    for i in want:
        np.testing.assert_array_equal(got[i], want[i], err_msg=f"weight {i}")


# Real filesystems of the test's own (root and mount(2) needed).


def mount(target: Path, *args: str) -> None:
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", *args, str(target)], check=True, capture_output=True)


def unmount(target: Path) -> None:
    subprocess.run(["umount", str(target)], check=True, capture_output=True)


def make_ext4(image: Path, megabytes: int = 16) -> None:
    with open(image, "wb") as f:
        f.truncate(megabytes << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)


@contextlib.contextmanager
def tmpfs(target: Path, size: str = "4m") -> Iterator[Path]:
    mount(target, "-t", "tmpfs", "-o", f"size={size}", "tmpfs")
    try:
        yield target
    finally:
        unmount(target)


@contextlib.contextmanager
def ext4(image: Path, target: Path) -> Iterator[Path]:
    """A fresh ext4 filesystem on a loop device, mounted at `target`."""
    make_ext4(image)
    mount(target, "-o", "loop", str(image))
    try:
        yield target
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            unmount(target)


def fill_disk(directory: Path) -> None:
    """Writes a file in `directory` until its filesystem is full (ENOSPC from the kernel)."""
    fd = os.open(directory / ".filler", os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (b"\0" * (1 << 16), b"\0" * (1 << 12)):
            try:
                while True:
                    os.write(fd, chunk)
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
    finally:
        os.close(fd)


_EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
_NOLOGFLUSH = 2  # as a power cut: nothing more reaches the disk, the journal not flushed


def shut_down(mount_point: Path) -> None:
    """Shuts the ext4 filesystem at `mount_point` down, as xfstests' `godown` does: every later
    call on it returns EIO, and what was not yet durable is lost when it is mounted again."""
    fd = os.open(mount_point, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _NOLOGFLUSH))
    finally:
        os.close(fd)


@contextlib.contextmanager
def failing_file(path: Path, image: Path, mount_point: Path) -> Iterator[Callable[[], None]]:
    """`path` served from an ext4 filesystem of its own (bind-mounted over it), shut down: every
    read of that file fails with EIO from the kernel, and nothing else does, until `heal()` (what
    the context gives) mounts the filesystem again, as an NFS server that comes back. The file may
    be moved meanwhile (with its directory): every mount under the directory holding `image` is
    unmounted on exit."""
    make_ext4(image)
    mount(mount_point, "-o", "loop", str(image))
    served = mount_point / path.name
    served.write_bytes(path.read_bytes())
    os.sync()

    def bind() -> None:
        subprocess.run(["mount", "--bind", str(served), str(path)], check=True, capture_output=True)

    def heal() -> None:
        unmount(path)
        unmount(mount_point)
        mount(mount_point, "-o", "loop", str(image))
        bind()

    bind()
    shut_down(mount_point)
    try:
        yield heal
    finally:
        for point in _mounts_under(image.parent):
            unmount(Path(point))


def _mounts_under(root: Path) -> list[str]:
    """The mount points under `root`, deepest first."""
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    return sorted((p for p in points if p.startswith(f"{root}/")), key=len, reverse=True)


def commits(sink: str, stage: str, fault: str) -> bool:
    """Whether an export with `fault` injected at the start of `stage` still commits: a fault at
    `prune` comes after the commit point; a full disk stops only what writes data (every file is
    staged by then, except a preset's configs, which it writes once the regions are in, and every
    export's checksums, written once every region is read back: all after the agreement)."""
    if stage in ("prune", "rename.last"):  # rename.last: the files renamed, not their sidecar
        return True
    if sink.startswith("step"):  # at "fsync", Orbax has renamed the step: only a power cut loses it
        return stage == "fsync" and fault != "EIO"
    if fault == "ENOSPC":
        return stage in ("fsync", "rename")
    return False


def fault_at(stage: str, fault: Any) -> Any:
    """A `storage.commit.on_stage` hook that runs `fault()` once, at the start of `stage`."""
    done = []

    def hook(current: str) -> None:
        if current == stage and not done:
            done.append(current)
            fault()

    return hook
