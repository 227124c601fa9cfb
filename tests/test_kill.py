"""SIGKILL during training with `ModelCheckpoint`: nothing committed is lost, nothing partial is
picked, the next run goes on. Two kills and a final run; `python -m benchmarks stress_kill` runs
many."""

from __future__ import annotations

from tests import _kill


def test_killed_anywhere_the_latest_committed_step_restores_exactly(tmp_path):
    plan = [
        ("async", "fast", "delete:7"),  # fresh run, killed inside a retention delete
        ("sync", "fast", "commit:1"),  # resumed run, killed just before its first save commits
        ("async", "fast", "none"),  # the run that finishes
    ]
    trials = [
        _kill.run_trial(tmp_path, _kill.Trial(i, mode, fmt, kill))
        for i, (mode, fmt, kill) in enumerate(plan)
    ]
    assert _kill.problems(trials, tmp_path) == []
    assert [t.killed for t in trials[:2]] == [True, True]  # the chosen kill points were reached
    assert trials[-1].returncode == 0 and "finished" in trials[-1].result
    for trial in trials[1:]:  # each resumed the latest committed step, exactly
        latest = trial.result["previous"]["steps"][-1]
        assert trial.result["previous"]["checked"][str(latest)] == "ok"
        assert trial.result["resumed"] == {"step": latest, "ok": True}
