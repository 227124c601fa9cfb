"""A keras-hub `GemmaBackbone` preset with pseudo-random weights, written without holding the model.

The backbone is built under `keras_orbax.deferred_init()` (no variable allocated); keras-hub's own
preset saver writes `config.json` and `metadata.json`; Keras's own save traversal
walks the layers and calls each one's `save_own_variables` into a store that makes each h5
dataset from the variable's shape and dtype alone and fills it a window at a
time from a generator seeded by the dataset's name. So the files are those `save_to_preset` writes
(`model.weights.h5`, or `model.weights.json` and its parts past `max_shard_size` GB), and making a
preset of 18.5 GB takes a few MiB of memory besides the interpreter's.

Private keras-hub symbols are used here (a benchmark, not the package) so that the preset's
non-weight files are keras-hub's, not a copy; Keras's walk and stores are those
`keras_orbax.save_weights` writes through (`compat.saving_compat.save_state`).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from typing import Any

import numpy as np

from tests._page_cache import evict  # seed_case.py puts the repository on the path

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
# Gemma2 9B's widths with fewer blocks, for one TPU v5e chip (15.75 GiB of HBM) in bfloat16:
# 5.67 B parameters (11.35 GB), which keras-hub's own loader also fits, and 7.26 B (14.52 GB), the
# most blocks that fit.
CONFIGS.update(
    tpu24={**CONFIGS["9b"], "num_layers": 24},
    tpu32={**CONFIGS["9b"], "num_layers": 32},
)
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
    from jax import numpy as jnp
    from keras_hub.src.utils import preset_utils

    import keras_orbax
    from keras_orbax._src.compat import saving_compat
    from keras_orbax._src.export import h5_regions

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
    else:
        path = os.path.join(directory, preset_utils.MODEL_WEIGHTS_FILE)
        max_shard_size = None
    written = {"bytes": 0, "datasets": 0, "unflushed": 0}

    def write(group: Any, key: str, variable: Any) -> None:
        """The dataset Keras would make for `variable`, filled from Philox (its value is never
        made: the backbone is deferred)."""
        dataset = h5_regions.create_dataset(group, key, variable.shape, variable.dtype)
        fill(dataset, np.dtype(jnp.dtype(variable.dtype)), window_bytes)  # h5py says V2 for bf16
        written["bytes"] += dataset.nbytes
        written["datasets"] += 1
        written["unflushed"] += dataset.nbytes
        if written["unflushed"] >= FLUSH_BYTES:
            # Without this the page cache would fill with the preset's dirty pages; on a machine
            # shared with other work, what is written is written back and dropped as it goes.
            group.file.flush()
            evict([group.file.filename])
            written["unflushed"] = 0

    # Keras's own walk and stores (those keras_orbax.save_weights writes through), each array
    # handed to `write` instead of fetched.
    saving_compat.save_state(backbone, path, write, max_shard_size=max_shard_size)
    files = sorted(os.listdir(directory))
    evict(os.path.join(directory, f) for f in files if f.endswith(".h5"))
    return {
        "seconds": time.perf_counter() - clock,
        "bytes": written["bytes"],
        "datasets": written["datasets"],
        "sharded": sharded,
        "files": files,
    }


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
