"""Kill-anywhere stress: many SIGKILLs of a training run with `keras_orbax.ModelCheckpoint`
(about 10 s per trial on 2 cores).

A case is one kind of kill; it runs `trials` trials of `tests/workers/kill_train.py` on one
checkpoint directory: async or sync saves, fast or compact format (random, seeded by `seed` and
the round), each killed at a random moment (`time`: SIGKILL from outside, 0-3 s into `fit`), inside
a retention delete (`delete`), just before a commit rename (`commit`) or at a metadata write
(`write`) (the trainer SIGKILLs itself just before the n-th such event), then one run to its end.
Every run first restores every committed step the previous one left and compares it with a
checksum ledger written before each save; then resumes (`resume=True`) and checks the restored
state against the ledger too. A case with any problem fails the run and names them (the trials'
logs and `report.json` stay in its work directory).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

from tests import _kill

LIMITS = {"delete": 40, "commit": 6, "write": 12}  # the n-th event of each kind a run reaches


def run_case(case: str, params: dict, work: str) -> dict:
    out = Path(work) / f"{case}_{params['_round']}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rng = random.Random(f"{params['seed']}-{case}-{params['_round']}")
    trials, start = [], time.perf_counter()
    for i in range(params["trials"] + 1):
        mode, fmt = rng.choice(["async", "sync"]), rng.choice(["fast", "fast", "compact"])
        kill = (
            f"time:{rng.uniform(0, 3):.3f}"
            if case == "time"
            else f"{case}:{rng.randint(1, LIMITS.get(case, 1))}"
        )
        trial = _kill.Trial(i, mode, fmt, kill if i < params["trials"] else "none")
        trials.append(_kill.run_trial(out, trial))
        previous = trials[-1].result.get("previous", {})
        print(f"{case} trial {i:3d} {mode:5s} {fmt:7s} kill {trial.kill:12s} -> rc "
              f"{trial.returncode}, found steps {previous.get('steps')}", flush=True)  # fmt: skip
    found = _kill.problems(trials, out)
    report = {"summary": _kill.summary(trials), "problems": found}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    if found:
        raise SystemExit(f"{case}: {len(found)} problems:\n" + "\n".join(found))
    return {"seconds": (time.perf_counter() - start) / len(trials), **report["summary"]}
