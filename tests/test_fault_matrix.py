"""The fault matrix: SIGKILL, ENOSPC and EIO at the start of each stage of the commit protocol
(`storage.commit`: stage, agree, fsync, rename, prune), for each export sink.

Every case ends with the previous export loading exactly (Keras's or keras-hub's own loader, and
every file byte for byte) and the failed one never loading, or, where the fault comes after the
commit point (or a full disk meets no more writes), the new export loading exactly. The faults are
real (`tests/_faults.py`): a full tmpfs, an ext4 filesystem shut down so that every call returns
EIO and then mounted again from its disk, a process that SIGKILLs itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import pytest

from keras_orbax._src.export import file_windows
from keras_orbax._src.storage import commit
from keras_orbax.errors import KerasOrbaxWarning, SaveFailedError
from tests import _faults, _harness
from tests._direct_io import direct_bytes_written

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="mounting a tmpfs or an ext4 image needs root"
)
CASES = [(sink, stage) for sink in _faults.SINKS for stage in _faults.STAGES]
CASES += [(sink, stage) for sink in _faults.STEP_SINKS for stage in _faults.STEP_STAGES]
_ids = [f"{sink}-{stage}" for sink, stage in CASES]


@pytest.fixture(scope="module")
def models():
    """Each sink's model (built once), with its previous and new values."""
    try:
        built = {}
        for sink in (*_faults.SINKS, *_faults.STEP_SINKS):
            model = _faults.built_sharded(sink)
            values = {seed: _faults.fill(model, seed) for seed in (_faults.NEW, _faults.PREVIOUS)}
            built[sink] = (model, values)
        yield built
    finally:
        keras.distribution.set_distribution(None)


@pytest.fixture(autouse=True)
def direct_writes(monkeypatch):
    """Every whole page of the Hugging Face export's bands goes with O_DIRECT (its bands are KiBs,
    under the 1 MiB it takes otherwise), so that each fault meets those writes too."""
    monkeypatch.setattr(file_windows, "DIRECT_MIN", file_windows.ALIGN)


@pytest.fixture(scope="module")
def new_hf_files(models, tmp_path_factory):
    """The Hugging Face export of the new values, written without a fault: what a committed
    case must hold, byte for byte."""
    model, _ = models["transformers"]
    root = tmp_path_factory.mktemp("new_hf")
    _faults.fill(model, _faults.NEW)
    _faults.export("transformers", model, root)
    return _faults.files(root)


def _check(sink, root, models, new_hf_files, *, before, committed, recorded=True):
    _, values = models[sink]
    _faults.assert_checksums_describe_the_export(sink, root, recorded)
    if committed:
        if sink == "transformers":
            assert _faults.files(root) == new_hf_files
        else:
            _faults.assert_values(_faults.loaded(sink, root), values[_faults.NEW])
        return
    assert _faults.kept_files(sink, root) == before  # the previous export, byte for byte
    if sink != "transformers":
        _faults.assert_values(_faults.loaded(sink, root), values[_faults.PREVIOUS])


# An export's; a new step's; the step an overwrite replaced, put back or kept aside (a shut-down
# disk refuses the rename back: the next listing does it).
_FAILED = (
    r"previous one is untouched|Saving step 2|Step 1 as it was before this save is (back|kept)"
)


def _failing_export(sink, model, root, stage, fault, committed):
    _faults.fill(model, _faults.NEW)
    with commit.on_stage(_faults.fault_at(stage, fault)):
        if committed and stage == "prune" and fault is not None:
            with pytest.warns(KerasOrbaxWarning, match="removing what it replaced failed"):
                _faults.export(sink, model, root)
        elif committed:
            _faults.export(sink, model, root)
        else:
            with pytest.raises(SaveFailedError, match=_FAILED):
                _faults.export(sink, model, root)


@pytest.mark.parametrize("disk", ["tmpfs", "ext4"])
def test_the_hugging_face_export_writes_straight_to_each_disk(tmp_path, models, disk):
    """The faults below meet O_DIRECT writes: on both filesystems the export writes pages so."""
    model, _ = models["transformers"]
    root = tmp_path / "disk"
    mounted = _faults.tmpfs(root) if disk == "tmpfs" else _faults.ext4(tmp_path / "ext4.img", root)
    with mounted, direct_bytes_written() as direct:
        _faults.export("transformers", model, root)
    assert direct and direct[0] >= 6 * file_windows.ALIGN, direct  # pages of each FFN kernel


@pytest.mark.parametrize(("sink", "stage"), CASES, ids=_ids)
def test_enospc(tmp_path, models, new_hf_files, sink, stage):
    model, _ = models[sink]
    with _faults.tmpfs(tmp_path / "disk") as root:
        _faults.fill(model, _faults.PREVIOUS)
        _faults.export(sink, model, root)
        before = _faults.kept_files(sink, root)
        committed = _faults.commits(sink, stage, "ENOSPC")
        # A full tmpfs refuses no unlink: the prune of a committed export succeeds, no warning.
        _faults.fill(model, _faults.NEW)
        with commit.on_stage(_faults.fault_at(stage, lambda: _faults.fill_disk(root))):
            if committed:
                _faults.export(sink, model, root)
            else:
                with pytest.raises(SaveFailedError, match="No space left on device"):
                    _faults.export(sink, model, root)
        (root / ".filler").unlink()
        _check(sink, root, models, new_hf_files, before=before, committed=committed)


@pytest.mark.parametrize(("sink", "stage"), CASES, ids=_ids)
def test_eio(tmp_path, models, new_hf_files, sink, stage):
    model, _ = models[sink]
    image, root = tmp_path / "ext4.img", tmp_path / "disk"
    with _faults.ext4(image, root):
        _faults.fill(model, _faults.PREVIOUS)
        _faults.export(sink, model, root)
        before = _faults.kept_files(sink, root)
        committed = _faults.commits(sink, stage, "EIO")
        _failing_export(sink, model, root, stage, lambda: _faults.shut_down(root), committed)
    # Mounted again: what the disk holds, not the page cache.
    _faults.mount(root, "-o", "loop", str(image))
    try:
        _check(sink, root, models, new_hf_files, before=before, committed=committed)
    finally:
        _faults.unmount(root)


# An overwrite killed just after it moved the old step aside, just before Orbax's rename, and just
# after it (the new step committed, the old one still aside): the other stages fall between these
# (a fork per case is 3-4 s of CI; ENOSPC and EIO above cover every stage).
_OVERWRITE_KILLS = ("stage", "rename", "fsync")
# A file export SIGKILLed between its files' renames and its sidecar's (`rename.last`, the old
# sidecar removed first): the new export loads, with no sidecar (`verify`: nothing recorded),
# never one describing the file it replaced.
_KILLED_BEFORE_THE_SIDECAR = [("weights.h5", "rename.last"), ("weights.json", "rename.last")]


def test_sigkill(tmp_path, models, new_hf_files):
    """One worker per sink and stage, each SIGKILLed at the start of its stage (forked from one
    process that imported Keras once); the next export then replaces what it left."""
    cases = []
    for sink, stage in CASES + _KILLED_BEFORE_THE_SIDECAR:
        if sink == "step.overwrite" and stage not in _OVERWRITE_KILLS:
            continue
        root = tmp_path / f"{sink}-{stage}"
        root.mkdir()
        model, _ = models[sink]
        _faults.fill(model, _faults.PREVIOUS)
        _faults.export(sink, model, root)
        cases.append({"sink": sink, "stage": stage, "root": str(root)})
    befores = {c["root"]: _faults.kept_files(c["sink"], Path(c["root"])) for c in cases}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", PYTHONPATH=str(_harness.REPO_ROOT))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    worker = _harness.WORKERS_DIR / "fault_kill.py"
    done = subprocess.run(
        [sys.executable, str(worker), str(tmp_path / "cases.json")],
        cwd=_harness.REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads((tmp_path / "cases.json.result").read_text())
    for case, code in zip(cases, codes, strict=True):
        sink, stage, root = case["sink"], case["stage"], Path(case["root"])
        assert code == -9, (case, code)  # killed where asked, never finished
        committed = _faults.commits(sink, stage, "SIGKILL")
        recorded = stage != "rename.last"
        _check(
            sink,
            root,
            models,
            new_hf_files,
            before=befores[str(root)],
            committed=committed,
            recorded=recorded,
        )
        if sink.startswith("step"):
            _check_left_by_a_killed_save(root / "ckpt")
        model, _ = models[sink]  # the next export replaces what the killed one left
        _faults.fill(model, _faults.NEW)
        _faults.export(sink, model, root)
        assert [
            p.name for p in root.iterdir() if p.name.startswith(".") and "lock" not in p.name
        ] == []
        _check(sink, root, models, new_hf_files, before={}, committed=True)


def _check_left_by_a_killed_save(ckpt):
    """A step an overwrite had moved aside is back (or, superseded, gone) once listed; `inspect`
    names each staging directory the killed save left, and says it was killed."""
    import keras_orbax

    assert not list(ckpt.glob(".keras_orbax.*.replaced"))
    staged = sorted(p.name for p in ckpt.glob("*.orbax-checkpoint-tmp*"))
    notes = keras_orbax.inspect(ckpt).leftovers
    assert [note.split(":")[0] for note in notes] == staged, notes
    assert all("before it was killed" in note for note in notes), notes


def test_a_task_preset_failing_on_its_backbone_keeps_the_previous_preset(tmp_path, models):
    """The disk has room for the task's weights but not the backbone's: keras-hub must not load
    the new head on the old backbone (the task's file used to be committed first)."""
    model, values = models["preset"]
    with _faults.tmpfs(tmp_path / "disk") as root:
        _faults.fill(model, _faults.PREVIOUS)
        _faults.export("preset", model, root)
        before = _faults.files(root)
        task_bytes = (root / "preset" / "task.weights.h5").stat().st_size
        _faults.fill_disk(root)
        os.truncate(root / ".filler", os.path.getsize(root / ".filler") - task_bytes - 16384)
        _faults.fill(model, _faults.NEW)
        with pytest.raises(SaveFailedError, match="No space left on device"):
            _faults.export("preset", model, root)
        (root / ".filler").unlink()
        assert _faults.files(root) == before
        _faults.assert_values(_faults.loaded("preset", root), values[_faults.PREVIOUS])


def test_two_processes(tmp_path, models):
    """2 processes x 4 devices, each fault injected by process 1: EIO (every process raises the
    same `SaveFailedError`, naming the processes it failed on), ENOSPC (the same), EFBIG on
    process 1 alone inside `keras_orbax.save` (both raise `SaveFailedError` naming process 1,
    process 0 without waiting in Orbax's commit barrier, whose limit is 20 minutes: the launch's
    own timeout stops that), a stall before Orbax's save-start barrier (process 0 gives up within
    `KERAS_ORBAX_SYNC_TIMEOUT_S`, where Orbax's own barrier waits without limit), a stall before
    the `AsyncCheckpointer`'s `async_write_complete` barrier (the same, where Orbax waits what
    remains of 20 minutes), a compact step missing process 1's OCDBT manifest (both refuse it),
    SIGKILL (process 0 gives up within `KERAS_ORBAX_SYNC_TIMEOUT_S`); each earlier export or step
    is left byte for byte and loads exactly."""
    image, ext4_root = tmp_path / "ext4.img", tmp_path / "ext4"
    roots = {
        "weights.h5": ext4_root,
        "transformers": tmp_path / "tmpfs",
        "step.fast": tmp_path / "s",
        "step.regions": tmp_path / "sr",
        "step.finalize": tmp_path / "sf",
        "step.start": tmp_path / "ss",
        "step.write_complete": tmp_path / "sw",
        "step.database": tmp_path / "sd",
        "preset": tmp_path / "p",
    }
    steps = ["step.fast", "step.regions", "step.finalize", "step.start"]
    steps += ["step.write_complete", "step.database"]
    for sink in ("preset", *steps):
        roots[sink].mkdir()
    (tmp_path / "w").mkdir()
    cases = [{"sink": sink, "root": str(root)} for sink, root in roots.items()]
    # Each case's wait for the missing process is this long: most of the test's time. Healthy
    # barriers here wait a second or two, under load too.
    env = {"KERAS_ORBAX_SYNC_TIMEOUT_S": "12"}
    with _faults.ext4(image, ext4_root), _faults.tmpfs(roots["transformers"]):
        worker = _harness.WORKERS_DIR / "fault_multi.py"
        with _harness.start_workers(
            worker, 2, 4, {"cases": cases}, workdir=tmp_path / "w", env=env
        ) as workers:
            workers.wait(600, expect_failure={0, 1})
        (roots["transformers"] / ".filler").unlink()
        first = json.loads((tmp_path / "w" / "cases_0.json").read_text())
        second = json.loads((tmp_path / "w" / "cases_1.json").read_text())
        for sink in ("weights.h5", "transformers"):
            # Where the fault surfaces first depends on timing (process 0 may be the one whose
            # write meets the full or shut-down disk); every process raises the same error.
            (mine,) = [c["error"] for c in first if c["sink"] == sink]
            (theirs,) = [c["error"] for c in second if c["sink"] == sink]
            assert mine == theirs, (sink, mine, theirs)
            assert mine.startswith("SaveFailedError") and " of 2 processes:" in mine, (sink, mine)
        hf = next(c for c in first if c["sink"] == "transformers")
        assert _faults.files(roots["transformers"]) == hf["before"]
    assert [c["sink"] for c in second] == ["weights.h5", "transformers", *steps]
    _check_step_on_two_processes(roots["step.fast"], first, second)  # killed in the last case
    for sink in steps[1:]:
        _check_step_fault(roots[sink], first, second, sink)
    preset = next(c for c in first if c["sink"] == "preset")
    assert preset["error"].startswith("ProcessSyncError"), preset
    assert "Processes [1] did not reach" in preset["error"], preset
    assert _faults.files(roots["preset"]) == preset["before"]
    _faults.assert_values(_faults.loaded("preset", roots["preset"]), models["preset"][1][0])
    _faults.mount(ext4_root, "-o", "loop", str(image))  # what the disk holds
    try:
        h5 = next(c for c in first if c["sink"] == "weights.h5")
        assert _faults.files(ext4_root) == h5["before"]
        _faults.assert_values(_faults.loaded("weights.h5", ext4_root), models["weights.h5"][1][0])
    finally:
        _faults.unmount(ext4_root)


def _check_step_on_two_processes(root, first, second):
    """Both processes raised the agreed `SaveFailedError` naming process 1's EFBIG; step 2 is not
    committed; step 1 is byte for byte as before and restores exactly."""
    import keras_orbax
    from keras_orbax._src.format import step_dirs
    from tests import _models
    from tests.workers.fault_multi import WIDE

    (mine,) = [c for c in first if c["sink"] == "step.fast"]
    (theirs,) = [c for c in second if c["sink"] == "step.fast"]
    for error in (mine["error"], theirs["error"]):
        assert error.startswith("SaveFailedError"), error
        assert "1 of 2 processes" in error and "process 1:" in error, error
        assert "File too large" in error, error
    assert step_dirs.committed_steps(root / "ckpt") == [1]
    assert _faults.files(root / "ckpt" / "1") == mine["before"]
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    saved, restored = _models.mlp(width=WIDE), _models.mlp(width=WIDE)
    previous = _faults.fill(saved, _faults.PREVIOUS)
    keras_orbax.restore_sharded(restored, root / "ckpt")
    _faults.assert_values({i: w.numpy() for i, w in enumerate(restored.weights)}, previous)


def _check_step_fault(root, first, second, sink):
    """Process 1 removed one of its shard files at the step's region check ("step.regions"): both
    raise the same `SaveFailedError` naming process 1's missing region. Or it failed at Orbax's
    finalize, after the agreement ("step.finalize"): process 0 raises `SaveFailedError` too, once
    Orbax's barrier gives up, within `KERAS_ORBAX_SYNC_TIMEOUT_S` (12 s here) of the agreement,
    not Orbax's 20 minutes. Or it stalled before Orbax's save-start barrier ("step.start"): process
    0 raises `SaveFailedError` naming that barrier once it gives up, within
    `KERAS_ORBAX_SYNC_TIMEOUT_S` (Orbax's own barrier would wait for process 1 without limit: it
    would arrive once its stall ends, 300 s on, and the step would commit); process 1, arriving
    late, raises too. Or it stalled in Orbax's background thread just before the
    `AsyncCheckpointer`'s `async_write_complete` barrier, after the agreement ("step.write_complete"):
    process 0 gives up within `KERAS_ORBAX_SYNC_TIMEOUT_S` there (then once more in Orbax's
    manager's barrier after a failed save), where Orbax waits what remains of its 20 minutes;
    process 1, arriving late, raises too. Or its OCDBT database's manifest was gone at the compact
    step's region check ("step.database"): both raise the same `SaveFailedError` naming process 1.
    Either way step 2 is not committed, and step 1 is byte for byte as before and restores
    exactly."""
    (mine,) = [c for c in first if c["sink"] == sink]
    (theirs,) = [c for c in second if c["sink"] == sink]
    for error in (mine["error"], theirs["error"]):
        assert error.startswith("SaveFailedError"), (sink, error)
    if sink in ("step.regions", "step.database"):
        assert mine["error"] == theirs["error"]
        assert "Not every region" in mine["error"] and "process 1: wrote" in mine["error"]
    elif sink == "step.write_complete":
        for error in (mine["error"], theirs["error"]):
            assert "async_write_complete" in error, error
    elif sink == "step.start":
        for error in (mine["error"], theirs["error"]):
            assert "Barrier timed out" in error and "save_start" in error, error
    else:
        # Process 0's wait is bounded by the launch's own timeout (600 s), under Orbax's 1200 s.
        assert "injected at Orbax's finalize" in theirs["error"], theirs
    _check_previous_step(root, mine["before"])


def _check_previous_step(root, before):
    import keras_orbax
    from keras_orbax._src.format import step_dirs
    from tests import _models
    from tests.workers.fault_multi import WIDE

    assert step_dirs.committed_steps(root / "ckpt") == [1]
    assert _faults.files(root / "ckpt" / "1") == before
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    saved, restored = _models.mlp(width=WIDE), _models.mlp(width=WIDE)
    previous = _faults.fill(saved, _faults.PREVIOUS)
    keras_orbax.restore_sharded(restored, root / "ckpt")
    _faults.assert_values({i: w.numpy() for i, w in enumerate(restored.weights)}, previous)


@pytest.mark.parametrize("stage", ["fsync", "rename"])
def test_convert_goes_through_the_same_protocol(tmp_path, models, stage):
    """`convert` to a `.weights.h5` is the export sink: EIO at its stages leaves the previous file."""
    import keras_orbax

    model, values = models["weights.h5"]
    _faults.fill(model, _faults.NEW)
    keras_orbax.save(model, tmp_path / "ckpt", step=1)
    image, root = tmp_path / "ext4.img", tmp_path / "disk"
    with _faults.ext4(image, root):
        _faults.fill(model, _faults.PREVIOUS)
        _faults.export("weights.h5", model, root)
        before = _faults.files(root)
        shut_down = _faults.fault_at(stage, lambda: _faults.shut_down(root))
        with (
            commit.on_stage(shut_down),
            pytest.raises(SaveFailedError, match="Input/output error"),
        ):
            keras_orbax.convert(tmp_path / "ckpt", root / "m.weights.h5", model=model)
    _faults.mount(root, "-o", "loop", str(image))
    try:
        assert _faults.files(root) == before
        _faults.assert_values(_faults.loaded("weights.h5", root), values[_faults.PREVIOUS])
    finally:
        _faults.unmount(root)
