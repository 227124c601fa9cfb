"""Restore time with the checksums checked (the default) against `verify=False`, and both against
the floor of the same work: the step's files read into fresh memory and put on the devices in the
target layout (`read_put`), warm page cache (issue 36: every restore checks what it reads, at no
measurable cost; issue 38: the 256 MiB restore within 1.3 x that floor). Each case is a fresh
process that does its work once untimed (thread pools, compiled placements), then once timed.

Layouts (`layout`), each a step saved once:
- `same`: a (rows, cols) float32 embedding (256 MiB at full size) saved split on its first axis
  over 8 devices, restored onto the same layout: each region is one shard file, checked by the
  thread that reads it, piece by piece as it reads.
- `reshard`: the same step restored split on the last axis: each region cuts every saved file;
  the pieces read are checked as they come.
- `mlp`: `layers` Dense(`width`) layers with Adam's state (many small files, each read and
  checked); its `read_put` reads the files only.

`--set timed=N` times N operations in each process after its untimed one, and reports their
medians (a shared machine's noise is mostly between processes; default 1). `--set base=DIR` restores the step already saved under DIR (by a run of another layout: `same` and
`reshard` read the same step) instead of saving one.
"""

from __future__ import annotations

import os

from benchmarks import bench_model as bm


def _mlp(layers: int, width: int):
    import keras

    keras.distribution.set_distribution(keras.distribution.DataParallel())
    inputs = keras.Input((width,))
    x = inputs
    for n in range(layers):
        x = keras.layers.Dense(width, name=f"dense_{n}")(x)
    model = keras.Model(inputs, x)
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def _model(params: dict, restore: bool):
    if params["layout"] == "mlp":
        return _mlp(params["layers"], params["width"])
    axes = (None, "model") if restore and params["layout"] == "reshard" else ("model", None)
    return bm.embedding(params["rows"], params["cols"], axes)


def _step(params: dict, work: str) -> str:
    return params.get("base") or work


def prepare(params: dict, work: str) -> None:
    import numpy as np

    import keras_orbax

    if params.get("base"):
        return
    model = _model(params, restore=False)
    for v in model.weights:
        v.assign(np.random.default_rng(0).random(v.shape).astype("float32"))
    keras_orbax.save(model, work, step=1, overwrite=True)


def _read_put(params: dict, step: str, model, pool) -> None:
    """Every shard file of the step read into fresh memory (`_fresh`) by the pool's threads; the embedding then put on the devices in its target
    layout, one `device_put`."""
    import jax

    state = os.path.join(step, "1", "state")
    files = [
        os.path.join(root, name)
        for root, _, names in os.walk(state)
        if os.path.basename(os.path.dirname(root)) != "keras_orbax_checksums"
        for name in names
        # a chunk's file: under `<array>/c/`, or `c.<key>` (the relative path: a work directory
        # whose own path holds "/c" is not a chunk)
        if os.sep + "c" in os.sep + os.path.relpath(root, state) or name.startswith("c.")
    ]
    sizes = [os.path.getsize(f) for f in files]
    if params["layout"] == "mlp":
        buffers = [_fresh(n) for n in sizes]
        targets = [(f, b.data) for f, b in zip(files, buffers, strict=True)]
    else:  # c/<row block>/0 of the (rows, cols) embedding: its rows of one fresh array
        whole = _fresh(params["rows"] * params["cols"] * 4)
        rows = len(files)
        per = whole.nbytes // rows
        order = sorted(files, key=lambda f: int(f.split(os.sep)[-2]))
        targets = [(f, whole.data[i * per : (i + 1) * per]) for i, f in enumerate(order)]

    def read(target) -> None:
        path, view = target
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [view], 0)
        finally:
            os.close(fd)

    list(pool.map(read, targets))
    if params["layout"] != "mlp":
        value = model.weights[0].value
        embedding = whole.view("float32").reshape(value.shape)
        jax.device_put(embedding, value.sharding).block_until_ready()


def _fresh(nbytes: int):
    """Fresh memory of its own mapping, advised huge pages: the cheapest to fill (issue 38's
    floor); the benchmark's own, so that it is the same floor for every version measured."""
    import mmap

    import numpy as np

    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= 2 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapping, dtype=np.uint8)[:nbytes]


def run_case(case: str, params: dict, work: str) -> dict:
    import statistics
    from concurrent.futures import ThreadPoolExecutor

    import keras_orbax

    step = _step(params, work)
    model = _model(params, restore=True)
    verify = None if case == "checked" else False
    timings = []
    with ThreadPoolExecutor(8) as pool:

        def once() -> None:
            if case == "read_put":
                _read_put(params, step, model, pool)
            else:
                keras_orbax.restore_sharded(model, step, verify=verify)

        once()  # warm: threads, compiled placements
        for _ in range(int(params.get("timed", 1))):
            clock = bm.clock()
            once()
            timings.append(bm.since(clock))
    return {
        "seconds": statistics.median(t[0] for t in timings),
        "cpu_s": statistics.median(t[1] for t in timings),
    }
