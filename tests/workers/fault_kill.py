"""Worker for tests/test_fault_matrix.py: for each case of a JSON list ({sink, stage, root}), forks
a child that exports the sink's model, with its new values, into `root` and SIGKILLs itself at the
start of `stage` (`storage.commit`'s `KERAS_ORBAX_TEST_KILL_AT`); writes each child's return code
(as `subprocess` gives it: -9 for SIGKILL) to `<cases>.result`.

Keras, keras-hub and keras-orbax are imported once, here, before JAX starts its backend (no thread
of it exists yet to be lost in a fork); each child starts its own.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import keras  # noqa: F401  (imported once for every child)
import keras_hub  # noqa: F401

from keras_orbax._src.storage import commit
from tests import _faults


def _child(case: dict) -> None:
    os.environ[commit.KILL_AT_ENV] = case["stage"]
    model = _faults.built_sharded(case["sink"])
    _faults.fill(model, _faults.NEW)
    _faults.export(case["sink"], model, Path(case["root"]))


def main() -> None:
    cases_path = Path(sys.argv[1])
    codes = []
    for case in json.loads(cases_path.read_text()):
        pid = os.fork()
        if pid == 0:
            try:
                _child(case)
                os._exit(0)
            except BaseException:
                import traceback

                traceback.print_exc()
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        codes.append(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
    cases_path.with_name(cases_path.name + ".result").write_text(json.dumps(codes))


if __name__ == "__main__":
    main()
