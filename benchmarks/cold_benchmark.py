"""Restore from a cold page cache, as a job starting on a fresh node meets it, against reading the
same files cold: each case starts with the step's files evicted (`posix_fadvise(DONTNEED)`, no root
needed) in a fresh process.

    read_cold   every file of the step read once with 8 threads (the floor)
    ko_cold     `deferred_init` + `restore_sharded` of the benchmark model with Adam
    touch       as many bytes of fresh memory as the step's files, every page touched once: what a
                restore also pays and the floor's reads into buffers freed at once do not (on this
                virtual machine it moves with what ran before: 0.3-1 s per GiB)
"""

from __future__ import annotations

import os

from benchmarks import bench_model as bm
from benchmarks.harness import files_of


def touch_fresh(nbytes: int) -> None:
    """Maps `nbytes` of fresh anonymous memory and writes one byte of each page."""
    import mmap

    import numpy as np

    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    np.frombuffer(memory, np.uint8)[:: mmap.PAGESIZE] = 1


def prepare(params: dict, work: str) -> None:
    import keras

    import keras_orbax

    keras.distribution.set_distribution(bm.make_distribution())
    spec = bm.ModelSpec(params_gib=params["params_gib"])
    keras_orbax.save(bm.build_model(spec), work, step=1, overwrite=True)


def run_case(case: str, params: dict, work: str) -> dict:
    if case == "read_cold":
        clock = bm.clock()
        nbytes = sum(b.nbytes for b in bm.read_all(work))
        return {"seconds": bm.since(clock)[0], "bytes": nbytes}
    if case == "touch":
        nbytes = sum(os.path.getsize(path) for path in files_of(work))
        clock = bm.clock()
        touch_fresh(nbytes)
        return {"seconds": bm.since(clock)[0], "bytes": nbytes}
    import keras

    import keras_orbax

    keras.distribution.set_distribution(bm.make_distribution())
    optimizer = keras.optimizers.Adam(1e-3)
    with keras_orbax.deferred_init():
        spec = bm.ModelSpec(params_gib=params["params_gib"])
        model = bm.build_model(spec, optimizer=optimizer, build_optimizer=False)
    clock = bm.clock()
    result = keras_orbax.restore_sharded(model, work)
    return {"seconds": bm.since(clock)[0], "bytes": result.bytes_read}
