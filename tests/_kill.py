"""Kill-anywhere trials: runs `workers/kill_train.py` again and again on one checkpoint directory,
SIGKILLing it at chosen or random moments; each run first checks what the previous one left.

Used by `tests/test_kill.py` (a few trials in CI) and `python -m benchmarks stress_kill` (many,
by hand).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests._harness import REPO_ROOT, WORKERS_DIR

TRAINER = WORKERS_DIR / "kill_train.py"
HANG_S = 300.0  # only to stop a hung run; no test asserts on time


@dataclasses.dataclass
class Trial:
    """One run of the trainer and what it found of the run before it."""

    index: int
    mode: str  # "async" or "sync"
    format: str  # "fast" or "compact"
    kill: str  # "none", "<event>:<n>" (the trainer kills itself) or "time:<seconds>" (we do)
    returncode: int | None = None
    result: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def killed(self) -> bool:
        return self.returncode == -signal.SIGKILL


def run_trial(workdir: Path, trial: Trial, epochs: int = 2) -> Trial:
    """Runs one trainer to its end or its kill; fills in `returncode` and `result`."""
    result_path = workdir / f"result_{trial.index}.json"
    timed = trial.kill.startswith("time:")
    # A timed kill counts from the start of `fit`: the trainer says so on this pipe.
    started, started_in_trainer = os.pipe() if timed else (-1, -1)
    args = {
        "directory": str(workdir / "ckpt"),
        "ledger": str(workdir / "ledger.txt"),
        "result": str(result_path),
        "mode": trial.mode,
        "format": trial.format,
        "seed": trial.index,
        "epochs": epochs,
        "kill": "none" if timed else trial.kill,
        "started_fd": started_in_trainer if timed else None,
    }
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        KERAS_BACKEND="jax",
        PYTHONPATH=str(REPO_ROOT),
    )
    try:
        with open(workdir / f"trial_{trial.index}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, str(TRAINER), json.dumps(args)],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                pass_fds=(started_in_trainer,) if timed else (),
            )
    finally:
        if timed:  # the trainer holds the only write end now: its exit ends the pipe
            os.close(started_in_trainer)
    try:
        # Blocks until the trainer writes (it started `fit`) or exits (the end of the pipe).
        if timed and select.select([started], [], [], HANG_S)[0] and os.read(started, 1):
            time.sleep(float(trial.kill.split(":")[1]))
            proc.send_signal(signal.SIGKILL)
        trial.returncode = proc.wait(timeout=HANG_S)
    finally:
        if timed:
            os.close(started)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if result_path.exists():
        trial.result = json.loads(result_path.read_text())
    return trial


def problems(trials: list[Trial], workdir: Path) -> list[str]:
    """Everything that went wrong across `trials`: a run that did not check the previous one's
    steps, a committed step that did not restore to its ledger checksum, a resume that did not
    pick the latest committed step or did not match, a run that neither finished nor was killed."""
    found = []
    for trial in trials:
        where = f"trial {trial.index} ({trial.mode}, {trial.format}, kill {trial.kill})"
        previous = trial.result.get("previous")
        if previous is None:
            found.append(f"{where}: did not check the previous run; see {_log(workdir, trial)}")
            continue
        steps = previous["steps"]
        for step, outcome in previous["checked"].items():
            if outcome != "ok" and int(step) == steps[-1]:
                found.append(f"{where}: latest committed step {step}: {outcome}")
            elif outcome not in ("ok",) and not outcome.startswith("error: Corrupt"):
                found.append(f"{where}: older committed step {step}: {outcome}")
        resumed = trial.result.get("resumed")
        if steps and resumed is None and "finished" not in trial.result and not trial.killed:
            found.append(f"{where}: did not resume; see {_log(workdir, trial)}")
        if resumed is not None and (not resumed["ok"] or resumed["step"] != steps[-1]):
            found.append(f"{where}: resumed {resumed}, latest committed step {steps[-1]}")
        if trial.returncode != 0 and not trial.killed:
            found.append(f"{where}: exited {trial.returncode}; see {_log(workdir, trial)}")
    return found


def summary(trials: list[Trial]) -> dict[str, Any]:
    """Counts for a report: kills, steps checked, partly deleted older steps seen."""
    checked = [o for t in trials for o in t.result.get("previous", {}).get("checked", {}).values()]
    return {
        "trials": len(trials),
        "killed": sum(t.killed for t in trials),
        "finished": sum("finished" in t.result for t in trials),
        "resumed_ok": sum(bool(t.result.get("resumed", {}).get("ok")) for t in trials),
        "steps_checked": len(checked),
        "steps_ok": checked.count("ok"),
        "older_steps_damaged": sum(o.startswith("error") for o in checked),
        "tmp_dirs_seen": sum(len(t.result.get("previous", {}).get("tmp", [])) for t in trials),
    }


def _log(workdir: Path, trial: Trial) -> str:
    log = workdir / f"trial_{trial.index}.log"
    tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
    return f"{log}:\n" + "\n".join(tail)
