"""Incremental saves: bytes written, save time and blocked time per `ModelCheckpoint` save, for LoRA
and for a full fine-tune of the same model, with and without `incremental`.

    python -m benchmarks incremental [--set frozen_gib=1] [--set epochs=6] [--set model=dense]

The model (`model=gemma`, the default): a keras-hub `GemmaBackbone` of width `width` (float32)
with as many decoder blocks as make `frozen_gib` GiB, trained to map tokens to zeros; "lora"
calls keras-hub's own `backbone.enable_lora(rank)` (the query and value kernels get LoRA factors,
everything else is frozen: Adam's state and the updates are the factors'), "full" trains it all.
`model=dense`: a stack of `Dense(width, use_bias=False)` layers instead, `enable_lora` on each.
Each case (lora/full x incremental/full saves x sync/async), in a fresh process, trains `epochs`
epochs of `steps` batches in a fresh directory with `keras_orbax.ModelCheckpoint` saving at every
epoch end, in the background (`*_async`: the time `fit` is blocked in `on_epoch_end`) or
synchronously (`*_sync`: the whole save, wall time, in `on_epoch_end`); its figure is the median
from the third save on. Counted from the filesystem, for each save after the
first: the bytes of new inodes ("written"), and the bytes of shard files whose content differs
from the previous step's ("changed", comparing the files byte for byte: the bytes an ideal
incremental save writes). The case `crc` is the time the candidate test's CRC (CRC-32C where
google-crc32c is installed, else CRC-32) takes over `frozen_gib` GiB on one thread (a link adds
reading the file back and comparing it). The restore time of the last step is measured too (it
should not depend on how the step was written). In each synchronous case, "changed-only save" (its floor):
the same writer saving only the trainable variables, optimizer and metric state (the floor for
"writing only the changed bytes").
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

# The harness sets the environment before it imports this module in the measured process.
import keras
import numpy as np

import keras_orbax
from benchmarks.hook_timer import TimedCallback
from keras_orbax._src.format import step_dirs

GEMMA_VOCABULARY, GEMMA_SEQUENCE = 32000, 16


def build_gemma(kind: str, width: int, layers: int, rank: int) -> keras.Model:
    """A keras-hub `GemmaBackbone` of `layers` decoder blocks of `width` (float32), trained to map
    tokens to zeros; "lora": keras-hub's own `enable_lora(rank)` (query and value kernels)."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=GEMMA_VOCABULARY,
        num_layers=layers,
        num_query_heads=8,
        num_key_value_heads=8,
        hidden_dim=width,
        intermediate_dim=4 * width,
        head_dim=width // 8,
    )
    if kind == "lora":
        backbone.enable_lora(rank)
    backbone.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return backbone


def gemma_data(n: int, width: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, GEMMA_VOCABULARY, (n, GEMMA_SEQUENCE), dtype=np.int32)
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    return x, np.zeros((n, GEMMA_SEQUENCE, width), "float32")


def gemma_layers(frozen_gib: float, width: int) -> int:
    """Decoder blocks for `frozen_gib` GiB of float32: 4 attention kernels of width x width and
    3 feed-forward ones of width x 2 width (Gemma splits `intermediate_dim` between gate and up)."""
    per_block = (4 * width * width + 3 * width * 2 * width) * 4
    embedding = GEMMA_VOCABULARY * width * 4
    return max(1, round((frozen_gib * (1 << 30) - embedding) / per_block))


def build(kind: str, width: int, layers: int, rank: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    x = inputs
    for i in range(layers):
        x = keras.layers.Dense(width, use_bias=False, name=f"dense_{i}")(x)
    model = keras.Model(inputs, x)
    if kind == "lora":
        for i in range(layers):
            model.get_layer(f"dense_{i}").enable_lora(rank)
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def shard_files(step_dir: Path) -> dict[str, Path]:
    state = step_dir / "state"
    return {
        os.fspath(p.relative_to(state)): p
        for p in state.rglob("*")
        if p.is_file()
        and len(p.relative_to(state).parts) > 1
        and p.parent.name != "_sharding"
        and "keras_orbax_checksums" not in p.parts
        and "array_metadatas" not in p.parts
        and p.name != "zarr.json"
        and not p.name.startswith("_")
    }


def per_save(directory: Path) -> list[dict[str, int]]:
    """For each step after the first: bytes of new inodes, and of files whose content changed."""
    steps = step_dirs.committed_steps(directory)
    out = []
    for before, after in itertools.pairwise(steps):
        old = shard_files(directory / str(before))
        new = shard_files(directory / str(after))
        written = changed = 0
        for name, path in new.items():
            size = path.stat().st_size
            prev = old.get(name)
            if prev is None or prev.stat().st_ino != path.stat().st_ino:
                written += size
            if prev is None or not same_bytes(prev, path):
                changed += size
        out.append(
            {
                "written": written,
                "changed": changed,
                "total": sum(p.stat().st_size for p in new.values()),
            }
        )
    return out


def same_bytes(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(8 << 20), fb.read(8 << 20)
            if x != y:
                return False
            if not x:
                return True


def run(kind: str, incremental: bool, background: bool, args: SimpleNamespace, work: Path) -> dict:
    n = args.steps * args.batch
    if args.model == "gemma":
        layers = gemma_layers(args.frozen_gib, args.width)
        make = build_gemma
        x, y = gemma_data(n, args.width)
    else:
        layers = max(1, round(args.frozen_gib * (1 << 30) / (args.width * args.width * 4)))
        make = build
        rng = np.random.default_rng(0)
        x = rng.standard_normal((n, args.width), dtype="float32")
        y = rng.standard_normal((n, args.width), dtype="float32")
    model = make(kind, args.width, layers, args.rank)
    directory = work / f"{kind}-{'inc' if incremental else 'full'}-{'bg' if background else 'sync'}"
    shutil.rmtree(directory, ignore_errors=True)
    checkpoint = keras_orbax.ModelCheckpoint(
        directory,
        max_to_keep=None,
        incremental=incremental,
        save_on_background=background,
    )
    timed = TimedCallback(checkpoint)
    model.fit(x, y, batch_size=args.batch, epochs=args.epochs, callbacks=[timed], verbose=0)
    saves = per_save(directory)
    floor = changed_only_save_s(model, work / "changed-only") if not background else None
    restored = make(kind, args.width, layers, args.rank)
    restored.optimizer.build(restored.trainable_variables)
    start = time.perf_counter()
    keras_orbax.restore_sharded(restored, directory)
    restore_s = time.perf_counter() - start
    result = {
        "kind": kind,
        "incremental": incremental,
        "background": background,
        "model": args.model,
        "layers": layers,
        "state_bytes": sum(v.value.nbytes for v in model.variables),
        "epoch_end_s": timed.seconds["on_epoch_end"],
        # From the third save on: past the first saves' one-off costs.
        "later_epoch_end_s": statistics.median(timed.seconds["on_epoch_end"][2:]),
        "saves": saves,
        "changed_only_save_s": floor,
        "restore_s": restore_s,
    }
    shutil.rmtree(directory, ignore_errors=True)
    return result


class _Holder(keras.Model):
    """A model whose only state is copies of `arrays`: what a save writing only them costs."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        super().__init__()
        self.held = []
        for i, array in enumerate(arrays):
            variable = self.add_weight(
                shape=array.shape, dtype=array.dtype, initializer="zeros", name=f"held_{i}"
            )
            variable.assign(array)
            self.held.append(variable)
        self.built = True

    def call(self, x):
        return x


def changed_only_save_s(model: keras.Model, directory: Path) -> float:
    """The floor for a save that writes only what training changed: the same writer (a sync
    `keras_orbax.save`, Orbax's metadata and commit, fsyncs) saving only the trainable variables,
    the optimizer's state and the metrics (what `fit` changes; frozen weights excluded). Median of
    3 saves into a fresh directory, `incremental=False` (nothing to compare against)."""
    changing = model.trainable_variables + model.optimizer.variables + model.metrics_variables
    holder = _Holder([np.asarray(v.value) for v in changing])
    shutil.rmtree(directory, ignore_errors=True)
    seconds = []
    for step in range(3):
        start = time.perf_counter()
        keras_orbax.save(holder, directory, step=step, incremental=False)
        seconds.append(time.perf_counter() - start)
    shutil.rmtree(directory, ignore_errors=True)
    return statistics.median(seconds)


def candidate_crc_s(nbytes: int) -> float:
    from keras_orbax._src.format import crc

    algorithm = crc.CRC32C or crc.CRC32
    data = np.random.default_rng(0).integers(0, 255, min(nbytes, 256 << 20), dtype=np.uint8)
    start = time.perf_counter()
    algorithm.of(memoryview(data))
    return (time.perf_counter() - start) * nbytes / data.nbytes


def run_case(case: str, params: dict, work: str) -> dict:
    """`crc`, or `<lora|full>_<inc|full>_<sync|async>`: one variant's training and saves."""
    if case == "crc":
        return {"seconds": candidate_crc_s(int(params["frozen_gib"] * (1 << 30)))}
    kind, saves, mode = case.split("_")
    r = run(kind, saves == "inc", mode == "async", SimpleNamespace(**params), Path(work))
    mib = 1 << 20
    return {
        "seconds": r["later_epoch_end_s"],
        **({"floor_s": r["changed_only_save_s"]} if r["changed_only_save_s"] else {}),
        "written_mib": statistics.mean(s["written"] for s in r["saves"]) / mib,
        "changed_mib": statistics.mean(s["changed"] for s in r["saves"]) / mib,
        "state_mib": statistics.mean(s["total"] for s in r["saves"]) / mib,
        "restore_s": r["restore_s"],
        "layers": r["layers"],
        "epoch_end_s": r["epoch_end_s"],
    }
