"""A keras-hub `GemmaBackbone` preset with pseudo-random weights, written without holding the model.

The backbone is built under `keras_orbax.deferred_init()` (no variable allocated); keras-hub's own
preset saver writes `config.json` and `metadata.json`; Keras's own save traversal
(`saving_lib._save_state`) walks the layers and calls each one's `save_own_variables` into a store
that makes each h5 dataset from the variable's shape and dtype alone and fills it a window at a
time from a generator seeded by the dataset's name. So the files are those `save_to_preset` writes
(`model.weights.h5`, or `model.weights.json` and its parts past `max_shard_size` GB), and making a
preset of 18.5 GB takes a few MiB of memory besides the interpreter's.

Private Keras and keras-hub symbols are used here (a benchmark, not the package) so that the
traversal, the group names and the preset's non-weight files are theirs, not a copy.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from typing import Any

import numpy as np

# The `gemma2_9b_en` preset's backbone (keras-hub's `gemma_presets.py` names it; its arguments are
# those keras-hub's Hugging Face converter gives Gemma 2 9B: intermediate_dim is twice
# `intermediate_size`). 9,241,705,984 parameters, as keras-hub's preset metadata says.
GEMMA2_ARGS = dict(
    query_head_dim_normalize=True,
    use_post_ffw_norm=True,
    use_post_attention_norm=True,
    final_logit_soft_cap=30.0,
    attention_logit_soft_cap=50.0,
    use_sliding_window_attention=True,
    sliding_window_size=4096,
    layer_norm_epsilon=1e-6,
    dtype="bfloat16",
)
CONFIGS: dict[str, dict[str, Any]] = {
    "9b": dict(
        vocabulary_size=256000,
        num_layers=42,
        num_query_heads=16,
        num_key_value_heads=8,
        hidden_dim=3584,
        intermediate_dim=28672,
        head_dim=256,
        **GEMMA2_ARGS,
    ),
    # `gemma2_2b_en`'s shape (2.61 B parameters, 5.2 GB); its 4 key/value heads load on (2, 4)
    # but not on (1, 8), which splits them 8 ways.
    "2b": dict(
        vocabulary_size=256000,
        num_layers=26,
        num_query_heads=8,
        num_key_value_heads=4,
        hidden_dim=2304,
        intermediate_dim=18432,
        head_dim=256,
        **GEMMA2_ARGS,
    ),
    # `gemma2_2b_en`'s widths with 4 layers and 8 key/value heads (its own 4 do not split 8
    # ways on the (1, 8) mesh): 0.92 B parameters, 1.8 GB, the embedding 1.2 GB.
    "medium": dict(
        vocabulary_size=256000,
        num_layers=4,
        num_query_heads=8,
        num_key_value_heads=8,
        hidden_dim=2304,
        intermediate_dim=18432,
        head_dim=256,
        **GEMMA2_ARGS,
    ),
    # 0.15 GB (75 M parameters), every dimension divisible by
    # the (1, 8) and (2, 4) meshes: the smoke size.
    "small": dict(
        vocabulary_size=32000,
        num_layers=4,
        num_query_heads=8,
        num_key_value_heads=8,
        hidden_dim=1024,
        intermediate_dim=4096,
        head_dim=128,
        **GEMMA2_ARGS,
    ),
}
WINDOW_BYTES = 64 * 2**20  # one generated and written block at most
FLUSH_BYTES = 1 << 30  # written back and dropped from the page cache every so many bytes


def make(
    directory: str | os.PathLike,
    backbone_args: dict[str, Any],
    max_shard_size: float | None = 10,
    window_bytes: int = WINDOW_BYTES,
) -> dict[str, Any]:
    """Writes the preset of `GemmaBackbone(**backbone_args)` into `directory`, as keras-hub's
    `save_to_preset(directory, max_shard_size)` would, with pseudo-random weights."""
    import keras_hub
    from keras.src.saving import saving_lib
    from keras_hub.src.utils import preset_utils

    import keras_orbax

    clock = time.perf_counter()
    with keras_orbax.deferred_init():
        backbone = keras_hub.models.GemmaBackbone(**backbone_args)
    os.makedirs(directory, exist_ok=True)
    saver = preset_utils.KerasPresetSaver(os.fspath(directory))
    saver._save_serialized_object(backbone, config_file=preset_utils.CONFIG_FILE)
    saver._save_metadata(backbone)
    size_gb = saver._get_variables_size_in_bytes(backbone.variables) / 1024**3
    # keras-hub's rule (`KerasPresetSaver.save_backbone`): sharded past `max_shard_size` GB.
    sharded = max_shard_size is not None and size_gb > max_shard_size
    if sharded:
        path = os.path.join(directory, preset_utils.SHARDED_MODEL_WEIGHTS_CONFIG_FILE)
        store: Any = _ShardedStore(path, max_shard_size, mode="w")
    else:
        store = _Store(os.path.join(directory, preset_utils.MODEL_WEIGHTS_FILE), mode="w")
    store.window_bytes = window_bytes
    saving_lib._save_state(
        backbone, weights_store=store, assets_store=None, inner_path="", visited_saveables=set()
    )
    store.close()
    _flush(store.written_files)
    return {
        "seconds": time.perf_counter() - clock,
        "bytes": store.bytes_written,
        "datasets": store.datasets,
        "sharded": sharded,
        "files": sorted(os.listdir(directory)),
    }


def _keras_classes() -> tuple[type, type]:
    from keras.src.saving.saving_lib import H5IOStore, ShardedH5IOStore

    return H5IOStore, ShardedH5IOStore


_H5IOStore, _ShardedH5IOStore = _keras_classes()


class _Streaming(_H5IOStore):  # type: ignore[misc, valid-type]
    """`H5IOStore.__setitem__` with the value made, not given: the dataset is created from the
    variable's shape and dtype (bfloat16 marked as Keras marks it) and filled a window at a time."""

    window_bytes = WINDOW_BYTES

    def _stream(self, key: str, variable: Any) -> int:
        if not self._h5_entry_initialized:
            self._create_h5_group(self._h5_entry_path)
        dtype = np_dtype(variable)
        dataset = self._h5_entry_group.create_dataset(key, shape=tuple(variable.shape), dtype=dtype)
        if dtype.name == "bfloat16":
            dataset.attrs["dtype"] = "bfloat16"
        fill(dataset, dtype, self.window_bytes)
        self.bytes_written = getattr(self, "bytes_written", 0) + dataset.nbytes
        self.datasets = getattr(self, "datasets", 0) + 1
        self.written_files = getattr(self, "written_files", set()) | {self.h5_file.filename}
        self._unflushed = getattr(self, "_unflushed", 0) + dataset.nbytes
        if self._unflushed >= FLUSH_BYTES:
            # Without this the page cache would fill with the preset's dirty pages; on a machine
            # shared with other work, what is written is written back and dropped as it goes.
            self.h5_file.flush()
            _flush([self.h5_file.filename])
            self._unflushed = 0
        return dataset.nbytes


class _Store(_Streaming):
    def __setitem__(self, key: str, variable: Any) -> None:
        self._stream(key, variable)


class _ShardedStore(_ShardedH5IOStore, _Streaming):  # type: ignore[misc, valid-type]
    """`ShardedH5IOStore.__setitem__`'s bookkeeping (its lines, in its order) around `_stream`:
    Keras's own method would first copy the variable to numpy, the very thing avoided here."""

    def __setitem__(self, key: str, variable: Any) -> None:
        from keras.src import backend
        from keras.src.utils import dtype_utils

        self._restore_h5_file()
        dtype = backend.standardize_dtype(variable.dtype)
        value_size = math.prod(variable.shape) * dtype_utils.dtype_size(dtype) / 8
        self.total_shard_size += value_size
        if value_size > self.max_shard_size:
            raise ValueError(f"The size of {key} exceeds the maximum shard size.")
        self.current_shard_size += value_size
        if self.current_shard_size > self.max_shard_size:
            self.close()
            self.h5_file = self._create_new_shard_file()
            self.current_shard_size = value_size
        self._stream(key, variable)
        variable_path = self._h5_entry_group.name
        shard_filename = self.current_shard_path.name
        weight_map = self.sharding_config["weight_map"]
        if variable_path not in weight_map:
            weight_map[variable_path] = shard_filename
        else:
            if not isinstance(weight_map[variable_path], list):
                weight_map[variable_path] = [weight_map[variable_path]]
            if shard_filename not in weight_map[variable_path]:
                weight_map[variable_path].append(shard_filename)


def np_dtype(variable: Any) -> np.dtype:
    """The numpy dtype Keras's `convert_to_numpy` gives the variable's value (ml_dtypes for
    bfloat16), read from the variable's dtype alone."""
    import keras
    import ml_dtypes

    name = keras.backend.standardize_dtype(variable.dtype)
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def fill(dataset: Any, dtype: np.dtype, window_bytes: int = WINDOW_BYTES) -> None:
    """Writes pseudo-random values of `dtype` (the variable's: h5py reads bfloat16 back as opaque
    2-byte data) into `dataset`, blocks of leading rows of at most
    `window_bytes` (one row at least), from Philox keyed by the dataset's name: the same bytes for
    the same name on every run, whatever the window."""
    rng = np.random.Generator(np.random.Philox(key=name_key(dataset.name)))
    shape = dataset.shape
    if not shape:
        dataset[()] = values(rng, 1, dtype)[0]
        return
    row = math.prod(shape[1:])
    rows = max(1, window_bytes // max(1, row * dtype.itemsize))
    for start in range(0, shape[0], rows):
        stop = min(shape[0], start + rows)
        block = values(rng, (stop - start) * row, dtype).reshape((stop - start, *shape[1:]))
        dataset.write_direct(block, dest_sel=np.s_[start:stop])


def name_key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=16).digest(), "little")


def values(rng: np.random.Generator, count: int, dtype: np.dtype) -> np.ndarray:
    """`count` values of `dtype`: floats of magnitude 2**-10 to 2**-6 with random signs (a
    bfloat16 bit pattern with a narrow exponent: finite through 42 layers, and every bit of the
    mantissa random, so nothing compresses), zeros for other dtypes."""
    import ml_dtypes

    if dtype.kind not in "fV":
        return np.zeros(count, dtype)
    bits = rng.integers(0, 1 << 16, size=count, dtype=np.uint16)
    bits &= 0x81FF  # sign, the exponent's two low bits, the mantissa
    bits += 117 << 7  # exponent 117-120: 2**-10 to 2**-7 times 1.x
    bf16 = bits.view(ml_dtypes.bfloat16)
    return bf16 if dtype == bf16.dtype else bf16.astype(dtype)


def _flush(paths: Any) -> None:
    """Writes each file back and drops it from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
