"""Several processes under `jax.distributed` on 127.0.0.1: each writes and reads only its own shards.

Launches are few and shared (module-scoped fixtures, each running several tasks in one cluster): a
2-process writer, 4 processes reading (and, with the local S3 server, writing a bucket), 2 reading
under other layouts and damage, and one killed mid-save.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import keras_orbax
from tests import _models
from tests._harness import WORKERS_DIR, WorkerFailed, run_workers

WORKER = WORKERS_DIR / "multihost.py"
SLACK = 32 * 1024  # bytes a process may read beyond its shards: zarr.json and metadata files
TIMEOUT_S = 600.0  # only to stop a hung launch; no test asserts on time


def _launch(
    num_processes: int, devices_per_process: int, tasks: list[dict[str, Any]], workdir: Path, **kw
) -> list[list[Any]]:
    """Runs `tasks` in turn in one cluster; for each task, what each process returned."""
    workdir.mkdir(parents=True, exist_ok=True)
    results = run_workers(
        WORKER,
        num_processes,
        devices_per_process,
        {"tasks": tasks},
        timeout=TIMEOUT_S,
        workdir=workdir,
        **kw,
    )
    return [[result["tasks"][i] for result in results] for i in range(len(tasks))]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """Checkpoints written by 2 processes x 4 devices on a (2, 4) mesh: `arange/1` and `trained/*`."""
    root = tmp_path_factory.mktemp("multihost")
    (results,) = _launch(2, 4, [{"action": "write", "directory": str(root)}], root / "w")
    assert results[0]["steps"] == results[1]["steps"] == [4, 8]
    return root


MODEL_BYTES = (16 * 4096 + 4096 + 4096 * 8 + 8) * 4  # the arrays of one step of `mlp(4096)`


def _assert_read(report: dict, layout: str) -> None:
    entry = report[layout]
    assert entry["mismatches"] == [], layout
    assert entry["sharding_ok"], layout
    # Array bytes: each distinct shard this process's devices own, read or received, exactly once.
    assert entry["bytes_read"] + entry["bytes_received"] == entry["own_shard_bytes"], (
        layout,
        entry,
    )
    # All bytes the process read from files (/proc/self/io), metadata included: `bytes_read` is real.
    assert entry["rchar"] <= entry["bytes_read"] + SLACK, (layout, entry)


@pytest.fixture(scope="module")
def four_processes(written, request) -> dict[str, Any]:
    """One launch of 4 processes x 2 devices. "read": step 1 restored under several layouts,
    replicas read once or not, and the trained run loaded. "bucket": where the local S3 server
    runs, `mlp` saved into a bucket and restored from it; else the skip (or failure) it gave."""
    tasks = [
        {
            "action": "read",
            "directory": str(written / "arange"),
            "layouts": ["2x4", "4x2", "1x8", "dp:on", "dp:off", "replicated:on", "replicated:off"],
            "trained": str(written / "trained"),
            "reference": str(written / "w" / "trained.npz"),
        }
    ]
    try:
        s3_store = request.getfixturevalue("s3_store")
    except (pytest.skip.Exception, pytest.fail.Exception) as outcome:
        s3_store, bucket = None, outcome
    else:
        url = s3_store.new_bucket()
        tasks.append({"action": "bucket", "directory": url, "layouts": ["dp", "replicated"]})
    reports = _launch(
        4, 2, tasks, written / "w4", env=s3_store.env if s3_store is not None else None
    )
    return {"read": reports[0], "bucket": reports[1] if s3_store is not None else bucket}


@pytest.fixture
def four_readers(four_processes) -> list[dict]:
    return four_processes["read"]


def test_four_processes_read_what_two_wrote(four_readers):
    for report in four_readers:
        _assert_read(report, "2x4")
        _assert_read(report, "4x2")
        _assert_read(report, "1x8")  # regions cut the saved rows: each process reads them together
        assert report["load_model"] == {"wrong": [], "iterations": 8}
    # The default on CPU: each process reads its replicas. Kernels split over all 8 devices,
    # biases replicated on all: kernels read once in all, biases once per process.
    replicated = (4096 + 8) * 4
    total = sum(report["2x4"]["bytes_read"] for report in four_readers)
    assert total == MODEL_BYTES + 3 * replicated


@pytest.mark.parametrize("layout", ["dp", "replicated"])
def test_each_replicated_byte_is_read_from_storage_once(four_readers, layout):
    """DataParallel (everything on every device) and kernels replicated over the "batch" axis, which
    spans the 4 processes: one process reads each region, the others receive it; the reading is
    spread over all of them. With `single_replica_reads=False` each process reads its replicas."""
    for report in four_readers:
        _assert_read(report, f"{layout}:on")
        _assert_read(report, f"{layout}:off")
    read = [report[f"{layout}:on"]["bytes_read"] for report in four_readers]
    assert sum(read) <= 1.05 * MODEL_BYTES, read
    assert min(read) > 0 and max(read) <= 1.5 * sum(read) / 4, read  # spread over the processes
    read_off = [report[f"{layout}:off"]["bytes_read"] for report in four_readers]
    assert sum(read_off) == 4 * MODEL_BYTES, read_off


def test_one_process_reads_what_two_wrote(written, distribution):
    distribution(_models.model_parallel((4, 2)))
    with keras_orbax.deferred_init():
        model = _models.mlp(width=4096)
    keras_orbax.restore_sharded(model, written / "arange")
    for variable, want in zip(
        model.variables, _models.arange_values([v.shape for v in model.variables]), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(variable.value), want)


@pytest.fixture(scope="module")
def two_processes(written, tmp_path_factory) -> dict[str, Any]:
    """One launch of 2 processes x 4 devices, with these tasks in turn:
    - "written", "single": step 1 of `arange` (2 processes wrote it) and of `single` (1 process
      wrote it) restored under another LayoutMap and (1, 8);
    - "own_view": each process restores its own copy of `arange`; process 1's has a step 5 too;
    - "damaged": `arange` with a shard file missing, then with a damaged shard index, then with a
      data bit flipped (last: each restore fails)."""
    root = tmp_path_factory.mktemp("two_processes")
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(_models.model_parallel((2, 4)))
    try:
        single = _models.mlp(width=4096)
        _models.fill_arange(single)
        keras_orbax.save(single, root / "single", step=1)
    finally:
        keras.distribution.set_distribution(previous)

    primary, other = root / "primary", root / "other"
    shutil.copytree(written / "arange", primary)
    shutil.copytree(written / "arange", other)
    shutil.copytree(other / "1", other / "5")  # a step process 1 sees and process 0 does not

    missing, bad_index, flipped = root / "missing", root / "bad_index", root / "flipped"
    shutil.copytree(written / "arange", missing)
    shutil.copytree(written / "arange", bad_index)
    shutil.copytree(written / "arange", flipped)
    # On the (2, 4) mesh, row 1 of the kernel's shards belongs to process 1's devices only.
    (missing / "1" / "state" / "layers.dense.vars.0" / "c" / "1" / "2").unlink()
    # The hidden bias (16 KiB, one piece) goes to process 0, the least loaded, lowest index.
    bias = bad_index / "1" / "state" / "layers.dense.vars.1" / "c" / "0"
    damaged = bytearray(bias.read_bytes())
    damaged[-1] ^= 0xFF  # the CRC-32C of the shard index
    bias.write_bytes(bytes(damaged))
    # One bit of the kernel's data in process 1's shard: caught as read, with no argument given.
    kernel = flipped / "1" / "state" / "layers.dense.vars.0" / "c" / "1" / "2"
    damaged = bytearray(kernel.read_bytes())
    damaged[8] ^= 0x01
    kernel.write_bytes(bytes(damaged))

    layouts = ["transposed", "1x8"]
    names = ["written", "single", "own_view", "save_mismatch", "damaged"]
    tasks = [
        {"action": "read", "directory": str(written / "arange"), "layouts": layouts},
        {"action": "read", "directory": str(root / "single"), "layouts": layouts},
        {"action": "read_own_view", "directories": [str(primary), str(other)]},
        {"action": "save_mismatch", "directory": str(root / "mismatch")},
        {
            "action": "read_expect_error",
            "directories": [str(missing), str(bad_index), str(flipped)],
        },
    ]
    return dict(zip(names, _launch(2, 4, tasks, root / "w"), strict=True))


@pytest.mark.parametrize("written_by", ["written", "single"])
def test_two_processes_read_with_another_layout_map_and_what_one_wrote(two_processes, written_by):
    for report in two_processes[written_by]:
        _assert_read(report, "transposed")
        _assert_read(report, "1x8")


def test_process_killed_during_save_leaves_the_previous_step(tmp_path):
    directory = tmp_path / "ckpt"
    with pytest.raises(WorkerFailed) as failed:
        _launch(2, 4, [{"action": "save_killed", "directory": str(directory)}], tmp_path / "w")
    assert (failed.value.process_id, failed.value.returncode) == (1, -9), str(failed.value)
    assert list(directory.glob("2.orbax-checkpoint-tmp*")), "nothing of step 2 was written"
    assert keras_orbax.inspect(directory).steps == (1,)
    with keras_orbax.deferred_init():
        model = _models.mlp()
    assert keras_orbax.restore_sharded(model, directory).step == 1


def test_damage_seen_by_one_process_fails_everywhere_without_hanging(two_processes):
    """A shard file missing on one process fails the plan; a shard that only one process reads
    (a bias replicated on both, read by process 0 alone) fails in the middle of the reads, before
    the collective that would send it to process 1; a flipped data bit in a shard only process 1
    reads fails its checksum as it is read. Each way: the same error everywhere (a hang fails the
    launch as WorkerFailed after its timeout)."""
    results = two_processes["damaged"]
    for n, (process, details) in enumerate(
        [
            (1, ["layers/dense/vars/0: missing file", "c/1/2"]),
            (0, ["CRC-32C", "vars.1"]),
            (1, ["layers/dense/vars/0: ", "c/1/2: checksum 0x"]),
        ]
    ):
        reports = [r["restores"][n] for r in results]
        assert [r["type"] for r in reports] == ["CorruptCheckpointError"] * 2, reports
        messages = {r["message"] for r in reports}
        assert len(messages) == 1, messages  # the same error on every process
        message = messages.pop()
        assert "failed on 1 of 2 processes" in message
        assert f"process {process}: CorruptCheckpointError" in message
        assert all(detail in message for detail in details), message
        assert all(r["untouched"] for r in reports)


def test_process_0_decides_the_step_for_every_process(two_processes):
    results = two_processes["own_view"]
    assert [r["step"] for r in results] == [1, 1]
    assert all(r["mismatches"] == [] for r in results)
    # Not silently: the process that was given another location is told.
    assert results[0]["warned"] == []
    (said,) = results[1]["warned"]
    assert said.startswith("restore_sharded on process 1 was given '") and "process 0 '" in said


def test_a_save_given_other_steps_on_other_processes_is_refused_everywhere(two_processes):
    """Different steps (or directories) per process had left both waiting in Orbax's barriers."""
    results = two_processes["save_mismatch"]
    assert [r["type"] for r in results] == ["ProcessSyncError"] * 2
    assert results[0]["message"] == results[1]["message"]
    message = results[0]["message"]
    assert "process 0: directory=" in message and "step=10" in message and "step=11" in message


def test_four_processes_write_and_read_a_bucket_once(four_processes):
    """4 processes x 2 devices save into S3 (each its own shards, committed by the marker), then
    restore under layouts that replicate across processes: every replicated region is fetched from
    the store by one process only (the default in object storage), values exact."""
    reports = four_processes["bucket"]
    if isinstance(reports, BaseException):  # the local S3 server's skip or failure
        raise reports
    for layout in ("dp", "replicated"):
        for report in reports:
            entry = report[layout]
            assert entry["mismatches"] == [], layout
            assert entry["sharding_ok"], layout
            assert entry["bytes_read"] + entry["bytes_received"] == entry["own_shard_bytes"]
        fetched = sum(report[layout]["bytes_read"] for report in reports)
        assert fetched <= 1.05 * MODEL_BYTES, (layout, fetched, MODEL_BYTES)
        assert all(report[layout]["bytes_read"] > 0 for report in reports), layout  # spread out
