"""Kill-anywhere stress: many SIGKILLs of a training run with `keras_orbax.ModelCheckpoint`.

Run by hand from the repository root (about 10 s per trial on 2 cores):

    python benchmarks/stress_kill.py --trials 60 --seed 0 --out /tmp/stress_kill

Each trial runs `tests/workers/kill_train.py` on the same checkpoint directory: async or sync
saves, fast or compact format, killed at a random moment (SIGKILL from outside, 0-3 s into
`fit`), inside a retention delete, just before a commit rename, or at a metadata write (the
trainer SIGKILLs itself just before the n-th such event). Every run first restores every
committed step the previous one left and compares it with a checksum ledger written before each
save; then resumes (`resume=True`) and checks the restored state against the ledger too. Prints a
JSON summary and every problem; exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import _kill


def plan(rng: random.Random) -> tuple[str, str, str]:
    mode = rng.choice(["async", "sync"])
    fmt = rng.choice(["fast", "fast", "compact"])
    kind = rng.choice(["time", "time", "delete", "commit", "write"])
    if kind == "time":
        return mode, fmt, f"time:{rng.uniform(0, 3):.3f}"
    return mode, fmt, f"{kind}:{rng.randint(1, {'delete': 40, 'commit': 6, 'write': 12}[kind])}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/keras_orbax_stress_kill"))
    options = parser.parse_args()
    shutil.rmtree(options.out, ignore_errors=True)
    options.out.mkdir(parents=True)
    rng = random.Random(options.seed)
    trials = []
    for i in range(options.trials):
        mode, fmt, kill = plan(rng) if i < options.trials - 1 else ("async", "fast", "none")
        trial = _kill.run_trial(options.out, _kill.Trial(i, mode, fmt, kill))
        trials.append(trial)
        previous = trial.result.get("previous", {})
        print(
            f"trial {i:3d} {mode:5s} {fmt:7s} kill {kill:12s} -> rc {trial.returncode}, "
            f"found steps {previous.get('steps')} {sorted(set(previous.get('checked', {}).values()))}"
            f", resumed {trial.result.get('resumed')}",
            flush=True,
        )
    found = _kill.problems(trials, options.out)
    by_kind: dict[str, dict[str, int]] = {}
    for trial in trials:
        kind = trial.kill.split(":")[0]
        counts = by_kind.setdefault(kind, {"trials": 0, "killed": 0})
        counts["trials"] += 1
        counts["killed"] += trial.killed
    report = {"summary": _kill.summary(trials), "by_kind": by_kind, "problems": found}
    (options.out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
