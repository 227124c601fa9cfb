"""A corpus of hostile and broken inputs, each made by damaging an intact source in a new directory.

`intact(root)` writes once what the builders copy: a keras-orbax step of each format, a
`.weights.h5`, a sharded `.weights.json`, a `.keras` (one small MLP, `cli_models.mlp`), a keras-hub
preset and a Hugging Face directory (one tiny Llama3). Each builder copies what it damages into
`work` and returns a `Hostile`: the location to pass, the path every refusal must name, and the
verbs that read what it damaged. Nothing here is committed as a binary; the memory worker
(`workers/hostile_bombs.py`) builds the bombs with the same functions.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import h5py
import keras
import numpy as np

import keras_orbax
from tests import cli_models
from tests._hub import import_keras_hub

LLAMA = dict(
    vocabulary_size=64,
    num_layers=1,
    num_query_heads=4,
    num_key_value_heads=4,
    hidden_dim=16,
    intermediate_dim=32,
)
KERNEL = "layers/dense/vars/0"  # the first Dense kernel, (16, 32) float32, in every MLP file
ARRAY = f"1/state/{KERNEL.replace('/', '.')}"  # its directory in a step
# Verbs by the kind of source: each reads the part a builder damages (`inspect` of a step reads
# its record and no array file; a preset's config.json is read by `from_preset` alone).
WEIGHTS_VERBS = ("restore_sharded", "inspect", "verify", "convert", "cli")
ARCHIVE_VERBS = ("restore_sharded", "load_model", "inspect", "verify", "convert", "cli")
HF_VERBS = ("restore_sharded", "from_preset", "inspect", "verify", "convert", "cli")
STEP_VERBS = ("restore_sharded", "load_model", "verify", "convert", "cli")


@dataclasses.dataclass(frozen=True)
class Hostile:
    location: Path
    named: Path  # what the error must name: the file, or the directory holding it
    architecture: str  # "mlp", "llama" (the preset's) or "tied_llama" (the HF directory's)


def llama() -> keras.Model:
    return import_keras_hub().models.Llama3Backbone(**LLAMA, tie_word_embeddings=False)


def tied_llama() -> keras.Model:
    return import_keras_hub().models.Llama3Backbone(**LLAMA, tie_word_embeddings=True)


BUILD = {"mlp": cli_models.mlp, "llama": llama, "tied_llama": tied_llama}


def intact(root: Path) -> None:
    """The sources every builder damages a copy of."""
    mlp = cli_models.mlp()
    mlp.compile(optimizer="adam", loss="mse")
    mlp.fit(np.ones((4, 16)), np.ones((4, 8)), verbose=0)
    keras_orbax.save(mlp, root / "fast", step=1)
    keras_orbax.save(mlp, root / "compact", step=1, format="compact")
    mlp.save_weights(root / "mlp.weights.h5")
    (root / "parts").mkdir()
    mlp.save_weights(root / "parts" / "mlp.weights.json", max_shard_size=0.001)
    mlp.save(root / "mlp.keras")
    llama().save_to_preset(str(root / "preset"))
    tied_llama().export_to_transformers(str(root / "hf"))


def _copy(intact: Path, name: str, work: Path) -> Path:
    destination = work / name
    if (intact / name).is_dir():
        shutil.copytree(intact / name, destination)
    else:
        shutil.copy(intact / name, destination)
    return destination


# --- Keras's h5 family -------------------------------------------------------------------------


def _replace_kernel(h5: Path, **dataset: object) -> None:
    with h5py.File(h5, "r+") as f:
        del f[KERNEL]
        f.create_dataset(KERNEL, **dataset)


def h5_shape_bomb(intact: Path, work: Path) -> Hostile:
    """A dataset declaring 4 TiB (chunked, compressed, no chunk written: read as the fill value)."""
    h5 = _copy(intact, "mlp.weights.h5", work)
    _replace_kernel(h5, shape=(2**20, 2**20), dtype="f4", chunks=(1024, 1024), compression="gzip")
    return Hostile(h5, h5, "mlp")


def h5_external_data(intact: Path, work: Path) -> Hostile:
    """A dataset whose bytes HDF5 reads from another file the weights file names."""
    h5 = _copy(intact, "mlp.weights.h5", work)
    outside = work / "outside.bin"
    outside.write_bytes(np.arange(16 * 32, dtype="<f4").tobytes())
    _replace_kernel(h5, shape=(16, 32), dtype="f4", external=[(str(outside), 0, 2048)])
    return Hostile(h5, h5, "mlp")


def h5_truncated(intact: Path, work: Path) -> Hostile:
    h5 = _copy(intact, "mlp.weights.h5", work)
    h5.write_bytes(h5.read_bytes()[: h5.stat().st_size // 2])
    return Hostile(h5, h5, "mlp")


def weights_json_part_outside(intact: Path, work: Path) -> Hostile:
    """A sharded index naming parts as `../<part>` (Keras takes each part beside its index)."""
    parts = _copy(intact, "parts", work)
    index = parts / "mlp.weights.json"
    nested = parts / "nested"
    nested.mkdir()
    index.rename(nested / index.name)
    index = nested / index.name
    config = json.loads(index.read_text())
    config["weight_map"] = {
        group: [f"../{part}" for part in ([files] if isinstance(files, str) else files)]
        for group, files in config["weight_map"].items()
    }
    index.write_text(json.dumps(config))
    return Hostile(index, index, "mlp")


def _rezip(archive: Path, into: Path, change: Callable[[zipfile.ZipFile], None]) -> None:
    """`archive`'s members copied into `into` as stored, then `change` adds its own."""
    with zipfile.ZipFile(archive) as source, zipfile.ZipFile(into, "w") as target:
        for info in source.infolist():
            target.writestr(info, source.read(info))
        change(target)


def keras_member_outside(intact: Path, work: Path) -> Hostile:
    """A `.keras` whose members are named `../...` and `assets/../../...` (keras#23101)."""
    archive = work / "mlp.keras"

    def add(target: zipfile.ZipFile) -> None:
        target.writestr("assets/../../escaped-by-hostile-input.txt", b"outside")
        target.writestr("../escaped-by-hostile-input.txt", b"outside")

    _rezip(intact / "mlp.keras", archive, add)
    return Hostile(archive, archive, "mlp")


BOMB_BYTES = 128 << 20


def keras_zip_bomb(intact: Path, work: Path) -> Hostile:
    """A `.keras` whose `config.json` inflates from about 128 KiB to 128 MiB (keras#23010)."""
    archive = work / "mlp.keras"
    with zipfile.ZipFile(intact / "mlp.keras") as source:
        config = source.read("config.json")
    with zipfile.ZipFile(intact / "mlp.keras") as source, zipfile.ZipFile(archive, "w") as target:
        for info in source.infolist():
            if info.filename != "config.json":
                target.writestr(info, source.read(info))
        padding = b" " * (BOMB_BYTES - len(config))
        target.writestr("config.json", config[:-1] + padding + b"}", zipfile.ZIP_DEFLATED, 1)
    return Hostile(archive, archive, "mlp")


def keras_shape_bomb(intact: Path, work: Path) -> Hostile:
    """A `.keras` whose `model.weights.h5` holds the 4 TiB dataset of `h5_shape_bomb`."""
    h5 = h5_shape_bomb(intact, work).location
    archive = work / "mlp.keras"
    with zipfile.ZipFile(intact / "mlp.keras") as source, zipfile.ZipFile(archive, "w") as target:
        for info in source.infolist():
            data = h5.read_bytes() if info.filename == "model.weights.h5" else source.read(info)
            target.writestr(info, data)
    h5.unlink()
    return Hostile(archive, archive, "mlp")


def keras_truncated(intact: Path, work: Path) -> Hostile:
    archive = _copy(intact, "mlp.keras", work)
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    return Hostile(archive, archive, "mlp")


# --- Hugging Face safetensors and keras-hub presets --------------------------------------------


def _safetensors(intact: Path, work: Path) -> tuple[Path, dict, bytes]:
    """A copy of the HF directory, its file's header and its data (`_safetensors(...)[0]`: the
    directory alone)."""
    directory = _copy(intact, "hf", work)
    raw = (directory / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return directory, json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _write_safetensors(file: Path, header: bytes, data: bytes) -> None:
    file.write_bytes(struct.pack("<Q", len(header)) + header + data)


def st_header_past_the_file(intact: Path, work: Path) -> Hostile:
    directory = _safetensors(intact, work)[0]
    file = directory / "model.safetensors"
    raw = bytearray(file.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 40)
    file.write_bytes(raw)
    return Hostile(directory, file, "tied_llama")


def st_offsets_past_the_file(intact: Path, work: Path) -> Hostile:
    directory, header, data = _safetensors(intact, work)
    name = next(n for n in header if n != "__metadata__")
    header[name]["data_offsets"][1] += 1 << 40
    file = directory / "model.safetensors"
    _write_safetensors(file, json.dumps(header).encode(), data)
    return Hostile(directory, file, "tied_llama")


def st_header_100mb(intact: Path, work: Path) -> Hostile:
    """A header of 100 MB of JSON: 1.7 million empty tensors (gigabytes as Python objects)."""
    directory = _safetensors(intact, work)[0]
    entry = b'"t%07d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},'
    count = 100_000_000 // len(entry % 0)
    body = b"{" + b"".join(entry % i for i in range(count))[:-1] + b"}"
    file = directory / "model.safetensors"
    _write_safetensors(file, body, b"")
    return Hostile(directory, file, "tied_llama")


def st_header_nested(intact: Path, work: Path) -> Hostile:
    """A header of JSON arrays nested a million deep."""
    directory = _safetensors(intact, work)[0]
    file = directory / "model.safetensors"
    _write_safetensors(file, NESTED_JSON.encode(), b"")
    return Hostile(directory, file, "tied_llama")


def st_index_part_outside(intact: Path, work: Path) -> Hostile:
    """An index naming its part `../model.safetensors`, outside the directory."""
    directory, header, _ = _safetensors(intact, work)
    (directory / "model.safetensors").rename(work / "model.safetensors")
    weight_map = {name: "../model.safetensors" for name in header if name != "__metadata__"}
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return Hostile(directory, index, "tied_llama")


def preset_absurd_vocabulary(intact: Path, work: Path) -> Hostile:
    """A preset whose config.json asks for a 10**12-token embedding (64 TB of float32)."""
    preset = _copy(intact, "preset", work)
    config = json.loads((preset / "config.json").read_text())
    config["config"]["vocabulary_size"] = 10**12
    (preset / "config.json").write_text(json.dumps(config))
    return Hostile(preset, preset, "llama")


# --- keras-orbax steps -------------------------------------------------------------------------


def _edit_json(file: Path, edit: Callable[[dict], None]) -> None:
    content = json.loads(file.read_text())
    edit(content)
    file.write_text(json.dumps(content))


def _set_chunks(spec: dict, shape: list[int], chunk: list[int]) -> None:
    spec["shape"] = shape
    spec["chunk_grid"]["configuration"]["chunk_shape"] = chunk
    spec["codecs"][0]["configuration"]["chunk_shape"] = chunk


def _set_record(step: Path, **fields: object) -> None:
    def edit(metadata: dict) -> None:
        for variable in metadata["custom_metadata"]["keras_orbax"]["variables"]:
            if variable["key"] == KERNEL:
                variable.update(fields)

    _edit_json(step / "1" / "_CHECKPOINT_METADATA", edit)


def zarr_shape_bomb(intact: Path, work: Path) -> Hostile:
    """A `zarr.json` declaring a 4 TiB array where the record says (16, 32)."""
    step = _copy(intact, "fast", work)
    spec = step / ARRAY / "zarr.json"
    _edit_json(spec, lambda s: _set_chunks(s, [2**20, 2**20], [2**20, 2**20]))
    return Hostile(step, spec, "mlp")


def step_grid_bomb(intact: Path, work: Path) -> Hostile:
    """A record and `zarr.json` agreeing on a 4 TiB array in (16, 32) chunks: 2**31 shard files
    to walk where there is one."""
    step = _copy(intact, "fast", work)
    _edit_json(step / ARRAY / "zarr.json", lambda s: _set_chunks(s, [2**20, 2**20], [16, 32]))
    _set_record(step, shape=[2**20, 2**20])
    return Hostile(step, step / "1", "mlp")


def shard_truncated(intact: Path, work: Path) -> Hostile:
    step = _copy(intact, "fast", work)
    shard = step / ARRAY / "c.0.0"
    shard.write_bytes(shard.read_bytes()[:100])
    return Hostile(step, shard, "mlp")


def compact_truncated(intact: Path, work: Path) -> Hostile:
    """Every data file of a compact step's OCDBT databases cut to a quarter (tensorstore may
    leave bytes no longer referenced at the end of one: a cut in half can miss every array)."""
    step = _copy(intact, "compact", work)
    for data in (step / "1" / "state").rglob("d/*"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 4])
    return Hostile(step, step / "1", "mlp")


def record_lies_about_dtype(intact: Path, work: Path) -> Hostile:
    """A step record saying int32 for an array stored as float32."""
    step = _copy(intact, "fast", work)
    _set_record(step, dtype="int32")
    return Hostile(step, step / "1", "mlp")


def zarr_lies_about_dtype(intact: Path, work: Path) -> Hostile:
    """A `zarr.json` saying int32 for float32 bytes (Orbax would read them as int32, then cast)."""
    step = _copy(intact, "fast", work)
    spec = step / ARRAY / "zarr.json"
    _edit_json(spec, lambda s: s.update(data_type="int32"))
    return Hostile(step, spec, "mlp")


NESTED_JSON = "[" * 10**6 + "]" * 10**6  # nested a million deep: past any parser's recursion


def record_nested(intact: Path, work: Path) -> Hostile:
    """A step's metadata file (its record) of JSON arrays nested a million deep."""
    step = _copy(intact, "fast", work)
    (step / "1" / "_CHECKPOINT_METADATA").write_text(NESTED_JSON)
    return Hostile(step, step / "1", "mlp")


def zarr_json_nested(intact: Path, work: Path) -> Hostile:
    step = _copy(intact, "fast", work)
    spec = step / ARRAY / "zarr.json"
    spec.write_text(NESTED_JSON)
    return Hostile(step, spec, "mlp")


def checksums_nested(intact: Path, work: Path) -> Hostile:
    """A fast step's checksum file of JSON nested a million deep."""
    step = _copy(intact, "fast", work)
    checksums = step / "1" / "state" / "keras_orbax_checksums" / "process_0.json"
    checksums.write_text(NESTED_JSON)
    return Hostile(step, checksums, "mlp")


def keras_state_nested(intact: Path, work: Path) -> Hostile:
    """A step's `keras_state/manifest.json` (layers' non-variable state) nested a million deep."""
    step = _copy(intact, "fast", work)
    (step / "1" / "keras_state").mkdir()
    (step / "1" / "keras_state" / "manifest.json").write_text(NESTED_JSON)
    return Hostile(step, step / "1", "mlp")


def hf_config_nested(intact: Path, work: Path) -> Hostile:
    """A Hugging Face directory whose config.json is JSON nested a million deep."""
    directory = _copy(intact, "hf", work)
    (directory / "config.json").write_text(NESTED_JSON)
    return Hostile(directory, directory / "config.json", "tied_llama")


# Each input's builder and the verbs that read what it damages.
VERBS: dict[Callable[[Path, Path], Hostile], tuple[str, ...]] = {
    h5_shape_bomb: WEIGHTS_VERBS,
    h5_external_data: WEIGHTS_VERBS,
    h5_truncated: WEIGHTS_VERBS,
    weights_json_part_outside: WEIGHTS_VERBS,
    keras_member_outside: ARCHIVE_VERBS,
    keras_zip_bomb: ARCHIVE_VERBS,
    keras_shape_bomb: ARCHIVE_VERBS,
    keras_truncated: ARCHIVE_VERBS,
    st_header_past_the_file: HF_VERBS,
    st_offsets_past_the_file: HF_VERBS,
    st_header_100mb: HF_VERBS,
    st_header_nested: HF_VERBS,
    st_index_part_outside: HF_VERBS,
    preset_absurd_vocabulary: ("from_preset",),
    zarr_shape_bomb: STEP_VERBS,
    step_grid_bomb: STEP_VERBS,
    shard_truncated: STEP_VERBS,
    compact_truncated: STEP_VERBS,
    record_lies_about_dtype: STEP_VERBS,
    zarr_lies_about_dtype: STEP_VERBS,
    record_nested: ("inspect", *STEP_VERBS),
    zarr_json_nested: STEP_VERBS,
    checksums_nested: STEP_VERBS,
    keras_state_nested: STEP_VERBS,
    hf_config_nested: HF_VERBS,
}
BUILDERS = {builder.__name__: builder for builder in VERBS}
VERBS_BY_NAME = {builder.__name__: verbs for builder, verbs in VERBS.items()}
# The bombs: each would make a reader allocate or parse far more than the file holds.
BOMBS = (
    "h5_shape_bomb",
    "keras_zip_bomb",
    "keras_shape_bomb",
    "st_header_100mb",
    "zarr_shape_bomb",
    "step_grid_bomb",
)


def model_for(hostile: Hostile) -> keras.Model:
    """A model `restore_sharded` reads the whole source into (the MLP's optimizer state too)."""
    model = BUILD[hostile.architecture]()
    if hostile.architecture == "mlp":
        model.compile(optimizer="adam", loss="mse")
        model.optimizer.build(model.trainable_variables)
    return model


def run_verb(
    verb: str, hostile: Hostile, destination: Path, model: keras.Model | None = None
) -> object:
    """`verb` on the hostile location, as a user calls it (`model`: the one `restore_sharded`
    restores into)."""
    location = hostile.location
    if verb == "restore_sharded":
        return keras_orbax.restore_sharded(model or model_for(hostile), location)
    if verb == "load_model":
        return keras_orbax.load_model(location)
    if verb == "from_preset":
        return keras_orbax.from_preset(import_keras_hub().models.Llama3Backbone, location)
    if verb == "inspect":
        return keras_orbax.inspect(location)
    if verb == "verify":
        return keras_orbax.verify(location)
    if verb == "convert":
        model = BUILD[hostile.architecture]() if hostile.architecture == "tied_llama" else None
        return keras_orbax.convert(location, destination, model=model)
    raise ValueError(verb)
