"""Several processes under `jax.distributed` on 127.0.0.1: each writes and reads only its own shards.

Launches are few and shared (module-scoped fixtures): a 2-process writer, then readers on other
topologies, and two fault scenarios.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

import keras_orbax
from tests import _models
from tests._harness import WORKERS_DIR, WorkerFailed, run_workers, start_workers

WORKER = WORKERS_DIR / "multihost.py"
SLACK = 32 * 1024  # bytes a process may read beyond its shards: zarr.json and metadata files


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """Checkpoints written by 2 processes x 4 devices on a (2, 4) mesh: `arange/1` and `trained/*`."""
    root = tmp_path_factory.mktemp("multihost")
    results = run_workers(
        WORKER, 2, 4, {"action": "write", "directory": str(root)}, workdir=_dir(root / "w")
    )
    assert results[0]["steps"] == results[1]["steps"] == [4, 8]
    return root


def _dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


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
def four_readers(written) -> list[dict]:
    """Step 1 restored by 4 processes x 2 devices under several layouts, replicas read once or not."""
    return run_workers(
        WORKER,
        4,
        2,
        {
            "action": "read",
            "directory": str(written / "arange"),
            "layouts": ["2x4", "4x2", "1x8", "dp:on", "dp:off", "replicated:on", "replicated:off"],
            "trained": str(written / "trained"),
            "reference": str(written / "w" / "trained.npz"),
        },
        workdir=_dir(written / "w4"),
    )


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


def test_two_processes_read_with_another_layout_map_and_what_one_wrote(
    written, tmp_path, distribution
):
    distribution(_models.model_parallel((2, 4)))
    single = _models.mlp(width=4096)
    _models.fill_arange(single)
    keras_orbax.save(single, tmp_path / "single", step=1)

    for directory in (written / "arange", tmp_path / "single"):
        results = run_workers(
            WORKER,
            2,
            4,
            {"action": "read", "directory": str(directory), "layouts": ["transposed", "1x8"]},
            workdir=_dir(tmp_path / f"w_{directory.name}"),
        )
        for report in results:
            _assert_read(report, "transposed")
            _assert_read(report, "1x8")


def test_process_killed_during_save_leaves_the_previous_step(tmp_path):
    directory = tmp_path / "ckpt"
    with start_workers(
        WORKER,
        2,
        4,
        {"action": "save_big", "directory": str(directory)},
        workdir=_dir(tmp_path / "w"),
    ) as workers:
        workers.wait_for_file(tmp_path / "w" / "saving", timeout=180)
        deadline = time.monotonic() + 60
        while not list(directory.glob("2.orbax-checkpoint-tmp*")) and time.monotonic() < deadline:
            time.sleep(0.01)
        workers.kill(1, signal.SIGKILL)
        with pytest.raises(WorkerFailed):
            workers.wait(timeout=120)
    assert keras_orbax.inspect(directory).steps == (1,)
    with keras_orbax.deferred_init():
        model = _models.mlp()
    assert keras_orbax.restore_sharded(model, directory).step == 1


def test_damage_seen_by_one_process_fails_everywhere_without_hanging(written, tmp_path):
    """A shard file missing on one process fails the plan; a shard that only one process reads
    (a bias replicated on both, read by process 0 alone) fails in the middle of the reads, before
    the collective that would send it to process 1. Either way: the same error everywhere."""
    import shutil

    missing, bad_index = tmp_path / "missing", tmp_path / "bad_index"
    shutil.copytree(written / "arange", missing)
    shutil.copytree(written / "arange", bad_index)
    # On the (2, 4) mesh, row 1 of the kernel's shards belongs to process 1's devices only.
    (missing / "1" / "state" / "layers.dense.vars.0" / "c" / "1" / "2").unlink()
    # The hidden bias (16 KiB, one piece) goes to process 0, the least loaded, lowest index.
    bias = bad_index / "1" / "state" / "layers.dense.vars.1" / "c" / "0"
    damaged = bytearray(bias.read_bytes())
    damaged[-1] ^= 0xFF  # the CRC-32C of the shard index
    bias.write_bytes(bytes(damaged))
    results = run_workers(  # a hang fails as WorkerFailed after the timeout
        WORKER,
        2,
        4,
        {
            "action": "read_expect_error",
            "directory": "",
            "directories": [str(missing), str(bad_index)],
        },
        timeout=300,
        workdir=_dir(tmp_path / "w"),
    )
    for n, (process, details) in enumerate(
        [(1, ["layers/dense/vars/0: missing file", "c/1/2"]), (0, ["CRC-32C", "vars.1"])]
    ):
        reports = [r["restores"][n] for r in results]
        messages = {r["message"] for r in reports}
        assert len(messages) == 1, messages  # the same error on every process
        message = messages.pop()
        assert [r["type"] for r in reports] == ["CorruptCheckpointError"] * 2
        assert "failed on 1 of 2 processes" in message
        assert f"process {process}: CorruptCheckpointError" in message
        assert all(detail in message for detail in details), message
        assert all(r["untouched"] for r in reports)


def test_process_0_decides_the_step_for_every_process(written, tmp_path):
    import shutil

    primary, other = tmp_path / "primary", tmp_path / "other"
    shutil.copytree(written / "arange", primary)
    shutil.copytree(written / "arange", other)
    shutil.copytree(other / "1", other / "5")  # a step process 1 sees and process 0 does not
    results = run_workers(
        WORKER,
        2,
        4,
        {"action": "read_own_view", "directory": "", "directories": [str(primary), str(other)]},
        workdir=_dir(tmp_path / "w"),
    )
    assert [r["step"] for r in results] == [1, 1]
    assert all(r["mismatches"] == [] for r in results)


def test_four_processes_write_and_read_a_bucket_once(s3_store, tmp_path):
    """4 processes x 2 devices save into S3 (each its own shards, committed by the marker), then
    restore under layouts that replicate across processes: every replicated region is fetched from
    the store by one process only (the default in object storage), values exact."""
    url = s3_store.new_bucket()
    reports = run_workers(
        WORKER,
        4,
        2,
        {"action": "bucket", "directory": url, "layouts": ["dp", "replicated"]},
        workdir=tmp_path,
        env=s3_store.env,
    )
    for layout in ("dp", "replicated"):
        for report in reports:
            entry = report[layout]
            assert entry["mismatches"] == [], layout
            assert entry["sharding_ok"], layout
            assert entry["bytes_read"] + entry["bytes_received"] == entry["own_shard_bytes"]
        fetched = sum(report[layout]["bytes_read"] for report in reports)
        assert fetched <= 1.05 * MODEL_BYTES, (layout, fetched, MODEL_BYTES)
        assert all(report[layout]["bytes_read"] > 0 for report in reports), layout  # spread out
