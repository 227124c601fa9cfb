"""The multi-process harness itself: one healthy cluster, one that fails on process 1."""

import signal

import pytest

from tests._harness import WORKERS_DIR, WorkerFailed, run_workers, start_workers

SMOKE = WORKERS_DIR / "harness_smoke.py"


def test_two_processes_form_one_eight_device_cluster():
    results = run_workers(SMOKE, num_processes=2, devices_per_process=4)

    assert [r["process_index"] for r in results] == [0, 1]
    for r in results:
        assert r["process_count"] == 2
        assert r["device_count"] == 8
        assert r["local_device_count"] == 4
        assert r["gathered"] == [0, 1]


def test_failure_on_process_1_kills_the_other_and_names_it():
    with start_workers(SMOKE, 2, 4, {"fail_on": [1]}) as workers:
        with pytest.raises(WorkerFailed, match=r"worker process 1 of 2 .* return code 1") as info:
            workers.wait(timeout=120)
        procs = workers.procs

    assert info.value.process_id == 1
    assert info.value.returncode == 1
    assert "Traceback (most recent call last)" in str(info.value)
    assert "RuntimeError: deliberate failure on process 1" in str(info.value)
    # Process 0 was blocked in a collective waiting for process 1: the harness killed it.
    assert procs[0].returncode == -signal.SIGKILL
    assert "process 0: killed by the harness" in str(info.value)
