"""Worker for tests/test_export_transformers.py: exports in processes of their own.

args: {"action": ..., "directory": ...}
- "disk_full" (1 process): exports once, then again with no file allowed past 16 KiB
  (RLIMIT_FSIZE, so writes fail with EFBIG); reports the error and each file's SHA-256 before
  and after.
- "memory" (1 process): a Llama3 backbone whose largest variable is 8 MiB, exported with a 1 MiB
  window; reports the peak RSS growth (VmHWM, reset through /proc/self/clear_refs) of
  keras_orbax's export and of keras-hub's own.
- "memory_moved" (1 process): a Gemma backbone whose hidden size is not heads x head_dim (its
  query projections transposed from host blocks), exported with a 1 MiB window;
  reports the peak RSS growth and the largest query projection's bytes.
- "multiprocess" (2 processes x 4 devices): Gemma and Llama3 backbones on a (2, 4) mesh of all 8
  devices exported (process 0 also writes keras-hub's export of the same values, unsharded); a
  Llama3 preset loaded sharded, LoRA-enabled, trained one step and exported (process 0 saves the
  expected values); then an export during which process 1 cannot write past 16 KiB; then the
  "memory" backbone exported, each process's peak RSS growth measured (between them, an export
  whose shared file process 1 changes before process 0 reads every region back); then that backbone
  exported with every band of a page or more written with O_DIRECT (`file_windows.DIRECT_MIN`
  lowered: its bands are KiBs), reporting the bytes each process wrote so (process 0 also writes
  keras-hub's export of the same values).
- "killed" (2 processes x 4 devices): process 1 is killed by SIGXFSZ at its first write past
  16 KiB, mid-export; process 0 reports the error it got, if it lives to.
"""

from __future__ import annotations

import hashlib
import resource
import signal
import tracemalloc
from pathlib import Path

import keras
import numpy as np
from jax.experimental import multihost_utils

import keras_orbax
from keras_orbax._src.export import file_windows
from tests import _hf_export
from tests._direct_io import direct_bytes_written
from tests._rss import peak_growth
from tests._worker_util import exit_now, init_worker, write_result


def _limit_file_size(nbytes: int) -> tuple[int, int]:
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death by signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    return old


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def disk_full(directory: Path) -> dict:
    keras.distribution.set_distribution(_hf_export.model_parallel("llama3"))
    backbone = _hf_export.backbone_class("llama3")(**_hf_export.config("llama3"))
    _hf_export.fill(backbone)
    keras_orbax.export_to_transformers(backbone, directory)
    before = _digests(directory)
    old = _limit_file_size(16 * 1024)
    error = _error_of(lambda: keras_orbax.export_to_transformers(backbone, directory))
    resource.setrlimit(resource.RLIMIT_FSIZE, old)
    return {"error": error, "before": before, "after": _digests(directory)}


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def memory(directory: Path) -> dict:
    backbone = _wide_llama3()
    ours = _export_growth(backbone, directory)
    theirs = peak_growth(lambda: backbone.export_to_transformers(str(directory / "keras_hub")))
    largest = max(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in backbone.variables)
    return {"ours": ours, "keras_hub": theirs, "largest_variable": largest}


def memory_moved(directory: Path) -> dict:
    keras.distribution.set_distribution(_hf_export.model_parallel("gemma"))
    keras.utils.set_random_seed(0)
    config = dict(_hf_export.GEMMA_SPLIT, vocabulary_size=1024, num_layers=2, hidden_dim=192)
    backbone = _hf_export.backbone_class("gemma")(
        **dict(config, head_dim=128, intermediate_dim=8192)
    )
    _hf_export.fill(backbone)
    query = backbone.get_layer("decoder_block_0").attention.query_dense.kernel
    largest = max(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in backbone.variables)
    return {
        "ours": _export_growth(backbone, directory),
        "query": int(np.prod(query.shape)) * np.dtype(query.dtype).itemsize,
        "largest_variable": largest,
    }


def _wide_llama3(mesh: tuple[int, int] | None = (2, 4)):  # type: ignore[no-untyped-def]
    """A Llama3 backbone on its `mesh` (on one device: None) whose largest variable, an 8 MiB FFN
    kernel, is 8 windows of 1 MiB."""
    distribution = _hf_export.model_parallel("llama3", mesh) if mesh else None
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)  # the same initial values on every process
    config = dict(_hf_export.LLAMA3, vocabulary_size=1024, num_layers=1, hidden_dim=256)
    config.update(num_query_heads=8, num_key_value_heads=8)  # heads split 8 ways on (1, 8)
    backbone = _hf_export.backbone_class("llama3")(**dict(config, intermediate_dim=8192))
    _hf_export.fill(backbone)
    return backbone


def _export_growth(backbone, directory: Path) -> int:  # type: ignore[no-untyped-def]
    """Peak RSS growth of `export_to_transformers(backbone)` with a 1 MiB window."""
    window = 1 << 20
    # Compiles the slices and loads the modules first, so that the figure is the export's alone.
    keras_orbax.export_to_transformers(backbone, directory / "warm", window_bytes=window)
    return peak_growth(
        lambda: keras_orbax.export_to_transformers(
            backbone, directory / "ours", window_bytes=window
        )
    )


def _memory_of_several(directory: Path) -> dict:
    """While this process writes its regions of the wide Llama3: its peak RSS growth, and the
    peak of NumPy's host buffers (tracemalloc, which freed memory reused cannot hide); the latter
    also while it copies its shards of the largest variable to the host (the measure sees one)."""
    backbone = _wide_llama3()
    tracemalloc.start()
    rss = _export_growth(backbone, directory)
    _, host_peak = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    largest = max(backbone.variables, key=lambda v: int(np.prod(v.shape)))
    held = [np.array(s.data) for s in largest.value.addressable_shards]
    _, copy_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "rss": rss,
        "host_peak": host_peak,
        "copy_peak": copy_peak,
        "held": sum(h.nbytes for h in held),
    }


def multiprocess(root: Path, process_id: int) -> dict:
    result: dict = {}
    for name in ("gemma", "llama3"):
        cls, config = _hf_export.backbone_class(name), _hf_export.config(name)
        keras.distribution.set_distribution(_hf_export.model_parallel(name))
        keras.utils.set_random_seed(0)  # the same initial values on every process
        backbone = cls(**config)
        _hf_export.fill(backbone)
        keras_orbax.export_to_transformers(
            backbone, root / name / "ours", window_bytes=_hf_export.WINDOW
        )
        spans = any(not v.value.is_fully_addressable for v in backbone.variables)
        result[name] = {"spans_processes": spans}
        if process_id == 0:  # keras-hub's export of the same values, on one device
            keras.distribution.set_distribution(None)
            reference = cls(**config)
            _hf_export.fill(reference)
            _hf_export.keras_hubs_export(reference, str(root / name / "keras_hub"))

    # Loaded sharded from a preset, LoRA-enabled, trained one step, exported.
    keras.distribution.set_distribution(None)
    if process_id == 0:
        original = _hf_export.backbone_class("llama3")(**_hf_export.LLAMA3)
        _hf_export.fill(original)
        original.save_to_preset(str(root / "preset"))
    multihost_utils.sync_global_devices("preset written")
    keras.distribution.set_distribution(_hf_export.model_parallel("llama3"))
    backbone = keras_orbax.from_preset(_hf_export.backbone_class("llama3"), root / "preset")
    keras.utils.set_random_seed(1)
    backbone.enable_lora(2)
    task = _hf_export.causal_lm_class("llama3")(backbone=backbone, preprocessor=None)
    _hf_export.train_one_step(task)
    keras_orbax.export_to_transformers(
        task, root / "trained" / "ours", window_bytes=_hf_export.WINDOW
    )
    expected = _gathered(_hf_export.exported_arrays(backbone))
    if process_id == 0:
        np.savez(root / "trained" / "expected.npz", **expected)

    # Process 1 cannot write past 16 KiB: both fail, no weights file is left.
    old = _limit_file_size(16 * 1024) if process_id == 1 else None
    error = _error_of(
        lambda: keras_orbax.export_to_transformers(
            backbone, root / "failed", window_bytes=_hf_export.WINDOW
        )
    )
    if old is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    result["failed"] = {"error": error}
    result["torn"] = _torn(backbone, root / "torn", process_id)
    result["memory"] = _memory_of_several(root / "memory")
    result["direct"] = _straight_to_the_disk(root / "wide", process_id)
    return result


def _torn(backbone: keras.Model, directory: Path, process_id: int) -> dict:
    """Process 1, once every process has written its regions and before it reports them, flips a
    byte of the shared file (a region of either process's: a torn or misplaced write on the
    shared filesystem); process 0 reads every region back before the commit, so both fail."""
    from keras_orbax._src.storage import commit

    staged = directory.with_name(f".{directory.name}.partial") / "model.safetensors"

    def tear(stage: str) -> None:
        if stage == "agree" and process_id == 1:
            with open(staged, "r+b") as f:
                f.seek(staged.stat().st_size // 2)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x01]))

    with commit.on_stage(tear):
        error = _error_of(
            lambda: keras_orbax.export_to_transformers(
                backbone, directory, window_bytes=_hf_export.WINDOW
            )
        )
    return {"error": error}


def _straight_to_the_disk(directory: Path, process_id: int) -> dict:
    """The wide Llama3 on a (1, 8) mesh, exported with O_DIRECT for every whole page; the bytes
    each process wrote so. Its kernels are split along one axis only, so that each process's
    regions of a transposed tensor are whole rows, one stretch of the file each (on the (2, 4)
    mesh they are half rows, runs of a KiB); the processes' stretches meet inside pages, which
    both write through the page cache."""
    backbone = _wide_llama3((1, 8))
    with direct_bytes_written(minimum=file_windows.ALIGN) as written:
        keras_orbax.export_to_transformers(backbone, directory / "ours", window_bytes=1 << 20)
    if process_id == 0:  # keras-hub's export of the same values, on one device
        _hf_export.keras_hubs_export(_wide_llama3(None), str(directory / "keras_hub"))
    return {"direct_bytes": sum(written)}


def killed(directory: Path, process_id: int) -> dict:
    keras.distribution.set_distribution(_hf_export.model_parallel("llama3"))
    keras.utils.set_random_seed(0)
    backbone = _hf_export.backbone_class("llama3")(**_hf_export.LLAMA3)
    _hf_export.fill(backbone)
    if process_id == 1:
        old = resource.getrlimit(resource.RLIMIT_FSIZE)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # the write past the limit kills
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, old[1]))
    error = _error_of(
        lambda: keras_orbax.export_to_transformers(
            backbone, directory, window_bytes=_hf_export.WINDOW
        )
    )
    return {"error": error}


def _gathered(arrays: dict) -> dict[str, np.ndarray]:
    return {
        k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in arrays.items()
    }


def main() -> None:
    ctx = init_worker()
    action, directory = ctx.args["action"], Path(ctx.args.get("directory", "."))
    if action == "disk_full":
        write_result(disk_full(directory))
    elif action == "memory":
        write_result(memory(directory))
    elif action == "memory_moved":
        write_result(memory_moved(directory))
    elif action == "killed":
        write_result(killed(directory, ctx.process_id))
        exit_now(0)  # the peer is dead: no shutdown barrier
    elif action == "multiprocess":
        write_result(multiprocess(directory, ctx.process_id))
    else:
        raise ValueError(f"unknown action {action!r}")


if __name__ == "__main__":
    main()
