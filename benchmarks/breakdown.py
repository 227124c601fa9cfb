"""Where the 256 MiB restore and a 256 MiB sync save spend their time, by sampling profiler.

One process repeats one operation `--loops` times (after one untimed warm-up) while py-spy samples
it with native frames (`py-spy record --native --format raw`); `classify` then sorts every sample
by its innermost recognisable frame into physical costs (read syscalls, copies, CRC, page faults,
device_put, fsync, Python) and reports each as a share of the samples.

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


def embedding(rows: int, cols: int, axes: tuple):
    import keras

    layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((8,), ("model",)))
    layout_map[".*embeddings"] = axes
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
    tokens = keras.Input((4,), dtype="int32")
    return keras.Model(tokens, keras.layers.Embedding(rows, cols, name="embed")(tokens))


def run(mode: str, work: str, rows: int = 65536, cols: int = 1024) -> dict:
    """Repeats `mode` after a warm-up until `<work>/<mode>.stop` exists, touching
    `<work>/<mode>.ready` once warm (the profiler attaches then); returns seconds and minor page
    faults per operation."""
    import numpy as np

    import keras_orbax

    step = os.path.join(work, "step")
    model = embedding(rows, cols, ("model", None))
    model.weights[0].assign(np.random.default_rng(0).random((rows, cols), dtype="float32"))
    if not os.path.exists(step):
        keras_orbax.save(model, step, step=1)
    if mode.startswith("restore_reshard"):
        model = embedding(rows, cols, (None, "model"))
    verify = False if mode.endswith("noverify") else None

    def once(i: int) -> None:
        if mode == "save":
            target = os.path.join(work, f"save_{i}")
            keras_orbax.save(model, target, step=1)
            shutil.rmtree(target)
        else:
            keras_orbax.restore_sharded(model, step, verify=verify)

    once(-1)  # warm: page cache, imports, compiled placements
    open(os.path.join(work, f"{mode}.ready"), "w").close()
    faults, start, loops = (
        resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
        time.perf_counter(),
        0,
    )
    while not os.path.exists(os.path.join(work, f"{mode}.stop")):
        once(loops)
        loops += 1
    return {
        "mode": mode,
        "seconds": (time.perf_counter() - start) / loops,
        "minor_faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / loops,
        "loops": loops,
    }


def profile(mode: str, work: str, seconds: float, py_spy: str) -> dict:
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
        f"print(json.dumps(breakdown.run({mode!r}, {work!r})))"
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
    result["main"] = shares(raws["python"], main_category, main_thread=True)
    result["pool"] = shares(raws["native"], pool_category, main_thread=False)
    return result


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
    total = sum(counts.values()) or 1
    return {k: round(v / total, 4) for k, v in counts.most_common()}


# Innermost frame first: (category, substrings of a frame). The main thread's frames are Python.
MAIN = [
    ("device_put", ("batched_device_put", "put_on_devices", "device_put")),
    ("CRC", ("checksum.py",)),
    ("waiting for the read threads", ("Future.result", "Condition.wait", "as_completed")),
    ("thread pool start/stop", ("Thread.start", "shutdown", "_adjust_thread_count")),
    ("fresh memory", ("aligned_empty",)),
    ("fsync", ("fsync",)),
    ("writes", ("write", "pwritev")),
    ("Python per region (keras-orbax)", ("keras_orbax/",)),
    ("Keras / JAX Python", ("keras/", "jax/")),
]
POOL = [
    ("CRC", ("crc32",)),
    ("read syscalls (copy from the page cache, faults of fresh pages)", ("preadv", "pread")),
    ("write syscalls", ("pwrite", "__libc_write")),
    ("fsync", ("fsync", "fdatasync")),
    ("freeing memory (munmap)", ("munmap",)),
    ("copies", ("memcpy", "memmove")),
    ("idle: waiting for work", ("_worker (concurrent",)),
]


def first_match(frames: list[str], table) -> str | None:
    for frame in reversed(frames):
        for label, needles in table:
            if any(needle in frame for needle in needles):
                return label
    return None


def main_category(frames: list[str]) -> str:
    return first_match(frames, MAIN) or "other"


def pool_category(frames: list[str]) -> str:
    label = first_match(frames, POOL)
    return label or ("other Python" if any(".py:" in f for f in frames) else "other native")
