"""Runs N worker scripts as one `jax.distributed` cluster on 127.0.0.1, for multi-process tests.

```python
results = run_workers(WORKERS_DIR / "harness_smoke.py", num_processes=2, devices_per_process=4)
```

Each worker is `sys.executable <script>` in its own session (process group) with its own
environment: `KERAS_BACKEND=jax`, `JAX_PLATFORMS=cpu`, `XLA_FLAGS` whose device count replaces any
inherited one, and the variables `_worker_util.init_worker()` reads (coordinator address, process
count and id, result path, `args` as JSON). Output goes to `<workdir>/worker_<i>.log`; each worker
writes `<workdir>/result_<i>.json` with `_worker_util.write_result`.

On any failure (non-zero exit, missing result, timeout) every worker is killed and `WorkerFailed`
names the process, its return code and the tail of its output. To signal a worker mid-run, use
`start_workers`, `tests._beacons.Beacon.wait` for a point the worker reaches, `Workers.kill`, then
`Workers.wait(expect_failure=...)`; survivors must end with `_worker_util.exit_now()`, since jax's
exit-time shutdown barrier waits for the dead worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn, cast

from tests import _worker_util as wu

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
WORKERS_DIR = TESTS_DIR / "workers"
TAIL_LINES = 60
COORDINATOR_GRACE_S = 30.0
"""How long other workers may keep running after process 0 (the coordination service) exits."""

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_DROPPED_ENV = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_COORDINATOR_BIND_ADDRESS",
    "JAX_LOCAL_DEVICE_IDS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
)


class WorkerFailed(AssertionError):
    """A worker failed and every worker was killed.

    Attributes:
        process_id: The worker that failed first.
        returncode: Its return code; `None` if it timed out.
        failures: Each failed worker's process id mapped to what happened to it.
    """

    def __init__(
        self, message: str, process_id: int, returncode: int | None, failures: dict[int, str]
    ) -> None:
        super().__init__(message)
        self.process_id = process_id
        self.returncode = returncode
        self.failures = failures


class Workers:
    """Handles on running workers; made by `start_workers`."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], script: Path, workdir: Path) -> None:
        self.procs = procs
        self.script = script
        self.workdir = workdir

    def log_path(self, process_id: int) -> Path:
        return self.workdir / f"worker_{process_id}.log"

    def result_path(self, process_id: int) -> Path:
        return self.workdir / f"result_{process_id}.json"

    def kill(self, process_id: int, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to one worker."""
        self.procs[process_id].send_signal(sig)

    def wait(
        self, timeout: float = 240, *, expect_failure: Collection[int] = ()
    ) -> list[dict[str, Any] | None]:
        """Waits for every worker to exit and returns their results, ordered by process id.

        Args:
            timeout: Seconds to wait in all.
            expect_failure: Workers whose non-zero exit is expected: their entry is `None`
                unless they exited 0 with a result.

        Raises:
            WorkerFailed: any other worker exited non-zero, wrote no result, or timed out.
        """
        self._wait_for_exits(timeout, expect_failure)
        return [self._result(i, expect_failure) for i in range(len(self.procs))]

    def kill_all(self) -> None:
        """SIGKILLs the process group of every worker still running and reaps them all."""
        for proc in self.procs:
            if proc.poll() is None:  # not reaped yet, so its pid (= its pgid) is still ours
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=60)

    def _wait_for_exits(self, timeout: float, expect_failure: Collection[int]) -> None:
        """Returns once every worker has exited; fails as soon as one fails, when `timeout` passes,
        or when others outlive process 0 (the coordination service) by `COORDINATOR_GRACE_S`.
        Each exit wakes it (a pidfd per worker): nothing polls."""
        pidfds = {os.pidfd_open(p.pid): p for p in self.procs}
        deadline = time.monotonic() + timeout
        coordinator_deadline: float | None = None
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                after = (
                    " after process 0 (the coordination service) exited" if codes[0] == 0 else ""
                )
                failed = {
                    i: _describe(c) + (after if i else "")
                    for i, c in enumerate(codes)
                    if c not in (None, 0) and i not in expect_failure
                }
                if failed:
                    self._fail(failed)
                running = [i for i, c in enumerate(codes) if c is None]
                if not running:
                    return
                now = time.monotonic()
                if codes[0] is not None and coordinator_deadline is None:
                    coordinator_deadline = now + COORDINATOR_GRACE_S
                if coordinator_deadline is not None and now > coordinator_deadline:
                    self._fail(
                        {
                            i: f"still running {COORDINATOR_GRACE_S:.0f}s after process 0 "
                            "(the coordination service) exited"
                            for i in running
                        }
                    )
                if now > deadline:
                    self._fail({i: f"timed out after {timeout:g}s" for i in running})
                wake = min(deadline, coordinator_deadline or deadline)
                watched = [fd for fd, p in pidfds.items() if p.returncode is None]
                select.select(watched, [], [], wake - now + 0.01)
        finally:
            for fd in pidfds:
                os.close(fd)

    def _result(self, i: int, expect_failure: Collection[int]) -> dict[str, Any] | None:
        path = self.result_path(i)
        if i in expect_failure and (self.procs[i].returncode != 0 or not path.exists()):
            return None
        if not path.exists():
            self._fail({i: f"exited with return code 0 but wrote no result to {path}"})
        return cast(dict[str, Any], json.loads(path.read_text()))

    def _fail(self, failures: dict[int, str]) -> NoReturn:
        """Kills every worker and raises WorkerFailed; `failures` lists the first failure first."""
        was_running = {i for i, p in enumerate(self.procs) if p.poll() is None}
        self.kill_all()
        n = len(self.procs)
        first = next(iter(failures))
        parts = [f"worker process {first} of {n} ({self.script.name}) {failures[first]}"]
        for i, reason in failures.items():
            parts.append(
                f"--- process {i} {reason}; last {TAIL_LINES} lines of "
                f"{self.log_path(i)}:\n{_tail(self.log_path(i))}"
            )
        others = [
            f"process {i}: "
            + ("killed by the harness" if i in was_running else _describe(p.returncode))
            for i, p in enumerate(self.procs)
            if i not in failures
        ]
        if others:
            parts.append("--- other workers: " + "; ".join(others))
        code = None if first in was_running else self.procs[first].returncode
        raise WorkerFailed("\n".join(parts), first, code, failures)


@contextlib.contextmanager
def start_workers(
    script: str | Path,
    num_processes: int,
    devices_per_process: int,
    args: Mapping[str, Any] | list[Any] | None = None,
    *,
    workdir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[Workers]:
    """Starts the workers; on leaving the block, kills any still running.

    Args:
        script: The worker script (see `_worker_util`).
        num_processes: How many processes form the cluster.
        devices_per_process: Virtual CPU devices each process gets.
        args: JSON-serializable arguments, given to every worker as `ctx.args`.
        workdir: Where logs and results go; a temporary directory, removed afterwards, if None.
        env: Extra environment variables for every worker (they win over the harness's own).

    Yields:
        The running `Workers`.
    """
    script = Path(script).resolve()
    if not script.is_file():
        raise FileNotFoundError(f"worker script not found. Received: script={script}")
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(
            "num_processes and devices_per_process must be >= 1. Received: "
            f"num_processes={num_processes}, devices_per_process={devices_per_process}"
        )
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="keras_orbax_"))
        workers = Workers([], script, Path(workdir))
        stack.callback(workers.kill_all)  # runs before the temporary directory is removed
        _launch(workers, num_processes, devices_per_process, args, env or {})
        yield workers


def run_workers(
    script: str | Path,
    num_processes: int,
    devices_per_process: int,
    args: Mapping[str, Any] | list[Any] | None = None,
    timeout: float = 240,
    *,
    workdir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Runs the workers to completion and returns their JSON results, ordered by process id.

    Arguments are those of `start_workers`, plus `timeout` in seconds for the whole run.

    Raises:
        WorkerFailed: a worker exited non-zero, wrote no result, or timed out; all were killed.
    """
    with start_workers(
        script, num_processes, devices_per_process, args, workdir=workdir, env=env
    ) as workers:
        return cast(list[dict[str, Any]], workers.wait(timeout))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(
    workers: Workers,
    num_processes: int,
    devices_per_process: int,
    args: Mapping[str, Any] | list[Any] | None,
    extra_env: Mapping[str, str],
) -> None:
    coordinator = f"127.0.0.1:{free_port()}"
    args_json = json.dumps(args)
    for i in range(num_processes):
        env = _worker_env(devices_per_process, extra_env)
        env.update(
            {
                wu.ENV_COORDINATOR: coordinator,
                wu.ENV_NUM_PROCESSES: str(num_processes),
                wu.ENV_PROCESS_ID: str(i),
                wu.ENV_RESULT_PATH: str(workers.result_path(i)),
                wu.ENV_WORKDIR: str(workers.workdir),
                wu.ENV_ARGS: args_json,
            }
        )
        with open(workers.log_path(i), "wb") as log:  # the child keeps its own descriptor
            workers.procs.append(
                subprocess.Popen(
                    [sys.executable, str(workers.script)],
                    env=env,
                    cwd=REPO_ROOT,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )


def _worker_env(devices_per_process: int, extra_env: Mapping[str, str]) -> dict[str, str]:
    """The parent's environment with the device count replaced, cluster and proxy variables
    dropped (workers talk to 127.0.0.1 only), and the repo root importable (`tests._worker_util`)."""
    env = {
        k: v for k, v in os.environ.items() if k not in _DROPPED_ENV and "_proxy" not in k.lower()
    }
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    flags.append(f"{_DEVICE_COUNT_FLAG}={devices_per_process}")
    paths = [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
    env.update(
        {
            "KERAS_BACKEND": "jax",
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": " ".join(flags),
            "PYTHONPATH": os.pathsep.join(paths),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra_env)
    return env


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name} (return code {returncode})"
    return f"exited with return code {returncode}"


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"<no output: {e}>"
    return "\n".join(text.splitlines()[-lines:]) or "<no output>"
