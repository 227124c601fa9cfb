"""Where the 256 MiB restore and a 256 MiB sync save spend their time, by sampling profiler.

Each case is one operation, repeated in one process (after one untimed warm-up) while
py-spy samples it `seconds` with Python frames, then `seconds` with native frames
(`py-spy record --format raw`); `classify` sorts every sample by its innermost recognisable frame
into physical costs (read syscalls, copies, CRC, page faults, device_put, fsync, Python), each a
share of the samples. Needs py-spy (`pip install py-spy`).

    restore_same       a (65536, 1024) float32 embedding saved split on axis 0 over 8 devices,
                       restored onto the same layout, page cache warm
    restore_reshard    the same step restored split on axis 1
    save               `keras_orbax.save` of that embedding (sync, fsynced) into a new directory

Each restore case runs with `verify=False` and with the default (checksums checked).
"""

from __future__ import annotations

import collections
import os
import resource
import shutil
import time

from benchmarks import bench_model as bm


def run(mode: str, work: str, rows: int = 65536, cols: int = 1024) -> dict:
    """Repeats `mode` after a warm-up until `<work>/<mode>.stop` exists, touching
    `<work>/<mode>.ready` once warm (the profiler attaches then); returns seconds and minor page
    faults per operation."""
    import numpy as np

    import keras_orbax

    step = os.path.join(work, f"step_{rows}x{cols}")
    model = bm.embedding(rows, cols, ("model", None))
    model.weights[0].assign(np.random.default_rng(0).random((rows, cols), dtype="float32"))
    if not os.path.exists(step):
        keras_orbax.save(model, step, step=1)
    if mode.startswith("restore_reshard"):
        model = bm.embedding(rows, cols, (None, "model"))
    verify = False if mode.endswith("noverify") else None

    def once(i: int) -> float:
        """Seconds of one operation (the save's delete afterwards is not counted)."""
        target = os.path.join(work, f"save_{i}")
        start = time.perf_counter()
        if mode == "save":
            keras_orbax.save(model, target, step=1)
        else:
            keras_orbax.restore_sharded(model, step, verify=verify)
        seconds = time.perf_counter() - start
        shutil.rmtree(target, ignore_errors=True)
        return seconds

    once(-1)  # warm: page cache, imports, compiled placements
    open(os.path.join(work, f"{mode}.ready"), "w").close()
    faults, seconds, loops = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, 0.0, 0
    while not os.path.exists(os.path.join(work, f"{mode}.stop")):
        seconds += once(loops)
        loops += 1
    return {
        "mode": mode,
        "seconds": seconds / loops,
        "libc_base": libc_base(),
        "minor_faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / loops,
        "loops": loops,
    }


def libc_base() -> int:
    """Where libc is mapped in this process: py-spy leaves its local symbols (the memcpy variants,
    the futex waits) as bare addresses, which `libc_symbol` names from the offset."""
    with open("/proc/self/maps") as f:
        for line in f:
            if "/libc.so" in line and line.split()[2] == "00000000":
                return int(line.split("-")[0], 16)
    return 0


def libc_symbols() -> list[tuple[int, str]]:
    import subprocess

    path = next(
        p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/libc.so.6") if os.path.exists(p)
    )
    out = subprocess.run(
        ["nm", "-D", "--defined-only", path], capture_output=True, text=True
    ).stdout
    symbols = [
        (int(a, 16), n)
        for a, t, n in (x.split()[:3] for x in out.splitlines() if x.count(" ") >= 2)
        if t in "Tt"
    ]
    return sorted(symbols)


def name_libc(frames: list[str], base: int, symbols: list[tuple[int, str]]) -> list[str]:
    """`frames` with bare libc addresses named after the nearest exported symbol below them."""
    import bisect

    named = []
    for frame in frames:
        if frame.startswith("0x") and "(libc.so" in frame and base and symbols:
            offset = int(frame.split()[0], 16) - base
            i = bisect.bisect_right(symbols, (offset, "~")) - 1
            if i >= 0:
                frame = f"{symbols[i][1]}+{offset - symbols[i][0]:#x} (libc.so.6)"
        named.append(frame)
    return named


def profile(mode: str, work: str, seconds: float, py_spy: str, rows: int, cols: int) -> dict:
    """Runs `mode` in a fresh process; once it is warm, samples it with py-spy for `seconds` with
    Python frames (every thread, idle included: the main thread's samples are the wall time) and
    then `seconds` with native frames (the pool threads' CPU: syscalls, CRC, copies)."""
    import json
    import subprocess
    import sys

    os.makedirs(work, exist_ok=True)
    ready, stop = os.path.join(work, f"{mode}.ready"), os.path.join(work, f"{mode}.stop")
    for path in (ready, stop):
        if os.path.exists(path):
            os.remove(path)
    code = (
        "import json; from benchmarks import bench_model as bm; bm.set_env(); "
        "from benchmarks import breakdown; "
        f"print(json.dumps(breakdown.run({mode!r}, {work!r}, {rows}, {cols})))"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    while not os.path.exists(ready):
        if child.poll() is not None:
            raise RuntimeError(f"{mode}: the child exited with {child.returncode}")
        time.sleep(0.1)
    raws = {}
    for kind, flags in (("python", ["--idle"]), ("native", ["--native"])):
        raws[kind] = os.path.join(work, f"{mode}.{kind}.raw")
        command = [py_spy, "record", "--format", "raw", "-r", "100", "--threads", *flags]
        command += ["-d", str(int(seconds)), "-o", raws[kind], "--pid", str(child.pid)]
        subprocess.run(command, check=True, capture_output=True)
    open(stop, "w").close()
    out, _ = child.communicate()
    result = json.loads(out.strip().splitlines()[-1])
    return dict(result, **classify(result, raws["python"], raws["native"]))


def classify(result: dict, python_raw: str, native_raw: str) -> dict:
    """The main thread's and the pool's shares from the two profiles of one mode."""
    symbols = libc_symbols()
    return {
        "main": shares(python_raw, main_category, main_thread=True),
        "pool": shares(
            native_raw,
            lambda frames: pool_category(name_libc(frames, result["libc_base"], symbols)),
            main_thread=False,
        ),
    }


def stacks(raw_path: str, main_thread: bool):
    """(frames innermost last, samples) of py-spy's raw output, one thread kind."""
    with open(raw_path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            if frames and ("MainThread" in frames[0]) == main_thread:
                yield frames[1:], int(n)


def shares(raw_path: str, categorize, main_thread: bool) -> dict[str, float]:
    counts: collections.Counter = collections.Counter()
    for frames, n in stacks(raw_path, main_thread):
        counts[categorize(frames)] += n
    counts.pop(EXCLUDED, None)
    total = sum(counts.values()) or 1
    return {k: round(v / total, 4) for k, v in counts.most_common()}


EXCLUDED = "(the benchmark deleting the last save)"
IDLE = "idle: waiting for work"
MAIN = [  # in priority order: the first whose substring any frame holds
    (EXCLUDED, ("_rmtree",)),
    ("device_put", ("batched_device_put", "put_on_devices", "device_put")),
    ("CRC", ("checksum.py",)),
    ("thread pools: start and stop", ("Thread.start", "shutdown", "_adjust_thread_count")),
    ("fsync", ("fsync",)),
    ("waiting for the I/O threads", ("Future.result", "as_completed", "Condition.wait")),
    ("writes", ("_write_all", "write_shard")),
    ("fresh memory", ("aligned_empty",)),
    ("Python per region (keras-orbax)", ("keras_orbax/",)),
    ("Keras / JAX Python", ("keras/", "jax/")),
]
POOL = [  # matched against the innermost native frame first
    ("CRC", ("crc32",)),
    ("read syscalls (copy from the page cache, faults of fresh pages)", ("preadv", "pread")),
    ("write syscalls", ("pwrite", "write (libc", "__libc_write")),
    ("fsync", ("fsync", "fdatasync")),
    ("faulting fresh memory in (`MADV_POPULATE_WRITE`)", ("madvise",)),
    ("mapping and unmapping memory", ("mmap64", "munmap")),
    ("copies", ("memcpy", "memmove", "raw_array_assign")),
    # glibc's futex waits have no exported name: the nearest one below them is __nptl_death_event
    ("waits (locks, the GIL)", ("futex", "pthread_cond", "sem_", "lll_lock", "__nptl_death_event")),
    (IDLE, ("epoll_wait",)),  # an event loop with nothing to do
]


def first_match(frames: list[str], table) -> str | None:
    for frame in reversed(frames):
        for label, needles in table:
            if any(needle in frame for needle in needles):
                return label
    return None


def main_category(frames: list[str]) -> str:
    for label, needles in MAIN:
        if any(needle in frame for frame in frames for needle in needles):
            return label
    return "other"


def pool_category(frames: list[str]) -> str:
    python = [f for f in frames if ".py:" in f]
    if python and python[-1].startswith("_worker (concurrent/futures/thread.py"):
        return IDLE  # blocked in the pool's queue: no work for this thread
    native = [f for f in frames if ".py:" not in f]
    label = first_match(native[-1:], POOL) if native else None
    return label or ("other Python" if python else "other native")


def markdown(report: dict) -> str:
    """Two tables, one column per mode: the main thread's wall time and the pool threads' work."""
    runs = {r["mode"]: r for r in report["runs"]}
    from benchmarks.registry import BY_NAME

    names = BY_NAME["breakdown"].cases
    modes = [m for m in names if m in runs]
    head = "| | " + " | ".join(names[m] for m in modes) + " |"
    rule = "|---|" + "---:|" * len(modes)
    lines = [head, rule]
    lines.append(
        "| ms per operation | "
        + " | ".join(f"{runs[m]['seconds'] * 1e3:.0f}" for m in modes)
        + " |"
    )
    lines.append(
        "| minor page faults per operation | "
        + " | ".join(f"{runs[m]['minor_faults']:.0f}" for m in modes)
        + " |"
    )
    lines.append(
        "| load average (1 min) after | "
        + " | ".join(f"{runs[m]['loadavg_1m']:.1f}" for m in modes)
        + " |"
    )
    for title, key in (
        ("**main thread** (share of wall time)", "main"),
        ("**pool threads** (share of busy samples)", "pool"),
    ):
        lines.append(f"| {title} |" + " |" * len(modes))
        shares = {m: busy(runs[m][key]) for m in modes}
        labels = sorted(
            {k for s in shares.values() for k in s},
            key=lambda k: -max(s.get(k, 0) for s in shares.values()),
        )
        for label in labels:
            lines.append(
                f"| {label} | " + " | ".join(f"{shares[m].get(label, 0):.0%}" for m in modes) + " |"
            )
    return "\n".join(lines) + "\n"


def busy(shares: dict[str, float]) -> dict[str, float]:
    """`shares` without the idle samples, renormalised."""
    total = sum(v for k, v in shares.items() if k != IDLE) or 1
    return {k: v / total for k, v in shares.items() if k != IDLE}


def run_case(case: str, params: dict, work: str) -> dict:
    import shutil as sh
    import sys

    py_spy = sh.which("py-spy", path=os.path.dirname(sys.executable)) or sh.which("py-spy")
    if not py_spy:
        raise SystemExit("py-spy is needed: pip install py-spy")
    return profile(case, work, params["seconds"], py_spy, params["rows"], params["cols"])


def render(result: dict, out_dir: str) -> str:
    from benchmarks.render import provenance

    runs = [dict(run, mode=case) for case, run in result["rounds"][0].items()]
    return markdown({"runs": runs}) + "\n" + provenance(result) + "\n"
