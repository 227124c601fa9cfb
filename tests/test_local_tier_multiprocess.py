"""`ModelCheckpoint(local_directory=...)` under jax.distributed: 2 processes x 4 CPU devices, each
with its own local directory; each keeps its part of every local step and a replica of its peer's,
sent over JAX's collectives. Two launches of the same job: the first trains a reference run
uninterrupted, crashes a second (an exception out of `fit`) and SIGKILLs a third; between the
launches the test deletes process 1's whole local directory of the killed run and damages process
0's newest part of the crashed one; the second launch resumes both, bitwise as the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.format import process_parts
from keras_orbax._src.format.step_record import StepRecord
from keras_orbax._src.restore import process_tier
from keras_orbax.errors import CheckpointNotFoundError
from tests import _models
from tests._harness import WORKERS_DIR, run_workers, start_workers

WORKER = WORKERS_DIR / "local_tier_multiprocess.py"
KILL_AFTER, CRASH_AFTER = 7, 6  # mid-epoch (4 batches an epoch): the persistent tier is at 4
LAST = 8  # 2 epochs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("local_tier_mp")
    args = {"root": str(root), "phase": "first", "kill_after": KILL_AFTER}
    args["crash_after"] = CRASH_AFTER
    (root / "w1").mkdir()
    with start_workers(WORKER, 2, 4, args, workdir=root / "w1") as workers:
        workers.wait(480, expect_failure={0, 1})  # both SIGKILLed after batch KILL_AFTER
        first = [json.loads(workers.result_path(i).read_text()) for i in range(2)]
    killed_local = {p: _parts(root / "killed" / f"local_{p}") for p in range(2)}
    shutil.rmtree(root / "killed" / "local_1")  # process 1's machine lost its local disk
    damaged = root / "damaged" / "local_0" / "process_0" / str(CRASH_AFTER)
    _flip_a_byte(damaged / process_parts.DATA)
    # Two neighbours lost: process 0's local directory, and process 1's replica of its parts.
    shutil.rmtree(root / "neighbours" / "local_0")
    shutil.rmtree(root / "neighbours" / "local_1" / "process_0")
    (root / "w2").mkdir()
    resume = {**args, "phase": "resume"}
    resumed = run_workers(WORKER, 2, 4, resume, timeout=480, workdir=root / "w2")
    resumed[0]["log"] = (root / "w2" / "worker_0.log").read_text()
    return root, first, killed_local, resumed


def _parts(local: Path) -> dict[str, list[int]]:
    return {p.name: process_parts.steps(p) for p in sorted(local.iterdir())}


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_each_process_keeps_its_part_and_a_replica_of_its_peers(runs):
    root, first, _, _ = runs
    last = LAST
    for me, peer in ((0, 1), (1, 0)):
        assert first[me]["reference_local"] == {
            f"process_{me}": [str(last - 1), str(last)],
            f"process_{peer}": [str(last - 1), str(last)],
        }
        for step in (last - 1, last):
            # The replica is the very bytes the peer wrote into its own local directory.
            own = root / "reference" / f"local_{peer}" / f"process_{peer}" / str(step)
            replica = root / "reference" / f"local_{me}" / f"process_{peer}" / str(step)
            for name in (process_parts.MANIFEST, process_parts.DATA):
                assert (replica / name).read_bytes() == (own / name).read_bytes()
    # `inspect` of the shared persistent directory names process 0's local tier and its parts.
    tier = keras_orbax.inspect(root / "reference" / "ckpt").local_tier
    held = [last - 1, last]
    assert tier == {
        "directory": str(root / "reference" / "local_0"),
        "parts": {"process_0": held, "process_1": held},
    }


def test_a_lost_local_directory_resumes_from_the_newest_local_step_with_the_peers_replica(runs):
    _, first, killed_local, resumed = runs
    newest = killed_local[0]["process_0"][-1]
    assert newest in (KILL_AFTER - 1, KILL_AFTER)  # newer than the persistent tier's step 4
    assert killed_local[0]["process_1"][-1] == newest  # process 1's part, kept by process 0
    for me in (0, 1):
        assert resumed[me]["killed"]["restored"] == newest
        assert resumed[me]["killed"]["digest"] == first[me]["reference"]  # bitwise, every shard
    assert any(
        "taken from the replica process 0 keeps" in w for w in resumed[1]["killed"]["warnings"]
    )
    assert resumed[1]["killed"]["local"]["process_1"][-2:] == [
        str(LAST - 1),
        str(LAST),
    ]  # the tier goes on
    killed = runs[0] / "killed"
    assert (  # which tier and step, on process 0 (verbose=1)
        f"Resuming from step {newest} of the local tier '{killed / 'local_0'}', newer than step "
        f"4, the newest of '{killed / 'ckpt'}', the parts of processes [1] from their peers' "
        "replicas"
    ) in resumed[0]["log"]


def test_a_damaged_part_is_set_aside_and_taken_from_the_peers_replica(runs):
    _, first, _, resumed = runs
    for me in (0, 1):
        assert resumed[me]["damaged"]["restored"] == CRASH_AFTER
        assert resumed[me]["damaged"]["digest"] == first[me]["reference"]
    assert f"{CRASH_AFTER}.unreadable" in resumed[0]["damaged"]["local"]["process_0"]  # kept
    assert any("is damaged" in w for w in resumed[0]["damaged"]["warnings"])


def test_two_neighbours_lost_fall_back_to_the_persistent_tier(runs):
    _, first, _, resumed = runs
    for me in (0, 1):
        assert resumed[me]["neighbours"]["restored"] == 4  # the persistent tier's newest
        assert resumed[me]["neighbours"]["digest"] == first[me]["reference"]
    # Process 1's own parts, of steps no process 0 part exists for, are kept aside.
    assert {f"{s}.unreadable" for s in (5, 6)} <= set(
        resumed[1]["neighbours"]["local"]["process_1"]
    )
    assert any("is not whole on every process" in w for w in resumed[1]["neighbours"]["warnings"])


def test_restore_sharded_takes_a_lost_part_from_the_peer(runs):
    _, _, _, resumed = runs
    for me in (0, 1):
        assert resumed[me]["restore_sharded"]["step"] == LAST
        assert resumed[me]["restore_sharded"]["digest"] == resumed[me]["killed"]["weights"]


def test_restore_sharded_of_an_intact_tier_restores_its_newest_step_exactly(runs):
    # Each process's own part only, read once and checked once (`process_tier.newest_whole`).
    _, first, _, resumed = runs
    for me in (0, 1):
        assert resumed[me]["restore_intact"] == {
            "step": LAST,
            "digest": first[me]["reference_weights"],
        }


def test_every_local_step_verifies_and_inspect_shows_each_processs_parts(runs):
    root, _, _, _ = runs
    for me, peer in ((0, 1), (1, 0)):
        local = root / "reference" / f"local_{me}"
        for step in (LAST - 1, LAST):
            result = keras_orbax.verify(local, step)
            assert result.intact and result.step == step and result.checksummed == 6
        info = keras_orbax.inspect(local)
        assert info.step == LAST and info.record.batch is None and info.record.epoch == 2
        held = (LAST - 1, LAST)
        assert info.parts == {f"process_{me}": held, f"process_{peer}": held}
        assert f"local tier: process_{peer}/ holds the parts of steps {list(held)}" in str(info)
    _flip_a_byte(root / "reference" / "local_1" / "process_0" / str(LAST) / process_parts.DATA)
    with pytest.raises(keras_orbax.errors.CorruptCheckpointError, match=r"data of .* is damaged"):
        keras_orbax.verify(root / "reference" / "local_1", LAST)


def test_one_process_cannot_restore_a_tier_of_several(runs):
    root, _, _, _ = runs
    with pytest.raises(CheckpointNotFoundError, match=r"written under jax\.distributed by 2"):
        keras_orbax.restore_sharded(_models.mlp(), root / "reference" / "local_0")


def test_a_write_failing_on_one_process_stops_fit_on_every_process(runs):
    _, _, _, resumed = runs
    for me in (0, 1):
        message = resumed[me]["failing"]
        assert "'local tier/before step 2' failed on 1 of 2 processes" in message
        assert "process 1: SaveFailedError: Saving step 1 to the local tier" in message
        assert "FileExistsError" in message


def test_another_run_holding_one_process_folder_stops_fit_on_every_process(runs):
    """Process 1's folder of the local directory held by another run of its machine: `fit` stops
    with `StepLockedError` on both processes, naming the holder, before anything is written."""
    root, _, _, resumed = runs
    lock = root / "held" / "local_1" / "process_1" / ".keras_orbax.lock"
    for me in (0, 1):
        message = resumed[me]["held"]
        assert "'local tier/run lock' failed on 1 of 2 processes" in message, message
        assert "process 1: StepLockedError" in message and "PID 4242 on other-run" in message
        assert str(lock) in message
    assert resumed[0]["held_local"] == {"process_0": []}  # its own folder made, nothing in it
    assert resumed[1]["held_local"] == {"process_1": [".keras_orbax.lock"]}  # the holder's
    assert not (root / "held" / "ckpt").exists() or not any((root / "held" / "ckpt").iterdir())


def test_a_part_damaged_in_flight_is_not_written(tmp_path):
    """What the receiver of a replica does with it (`process_parts.commit`), on one process."""
    record = StepRecord(step=3, variables={})
    shards = [("k", ((0, 4),), np.arange(4, dtype="float32"))]
    payload = bytearray(process_parts.pack(1, record, shards, None))
    payload[-5] ^= 0x01  # a byte of the shard's data
    with pytest.raises(keras_orbax.errors.CorruptCheckpointError, match=r"data of .* is damaged"):
        process_parts.commit(tmp_path / "process_1", bytes(payload))
    assert not (tmp_path / "process_1").exists()  # nothing written, nothing staged


def test_an_intact_tier_resumes_reading_each_own_part_once_and_no_replica(tmp_path):
    """The usual resume (every own part intact, no newer replica) reads this process's newest
    part once and no replica (a damaged one there goes unseen, as it is not needed); a damaged
    own part has every part of both folders checked, and the newest step whole chosen.
    On one process, whose peer is itself."""
    own, replica = tmp_path / "process_0", tmp_path / "replica"
    shards = [("k", ((0, 4),), np.arange(4, dtype="float32"))]
    for step in (3, 4):
        for into in (own, replica):
            process_parts.commit(
                into, process_parts.pack(0, StepRecord(step=step, variables={}), shards, None)
            )
    _flip_a_byte(replica / "4" / process_parts.DATA)

    choice = process_tier.newest_whole(own, replica)
    assert (choice.step, choice.missing, choice.damaged_replica) == (4, (), {})
    assert bytes(choice.own_part) == bytes(process_parts.payload(own / "4"))

    (own / "4" / process_parts.DATA).unlink()  # its data lost: damaged, not an error
    choice = process_tier.newest_whole(own, replica)
    assert (choice.step, choice.missing, choice.own_part) == (3, (), None)
    assert set(choice.damaged_own) == set(choice.damaged_replica) == {4}
    shutil.rmtree(own / "4")
    choice = process_tier.newest_whole(own, replica, step=3)
    assert choice.step == 3 and bytes(process_tier.part_of(own, replica, choice)) == bytes(
        process_parts.payload(own / "3")
    )
