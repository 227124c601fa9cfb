"""Private keras-hub symbols, each wrapped with why no public API serves. keras-hub is an optional
extra: each is imported only when called.

Tested with keras-hub 0.32.0 (`versions.SUPPORTED`), each resolved on first use and failing with
one `UnsupportedVersionError` if moved; tests/test_versions.py resolves every one.
"""

from __future__ import annotations

from typing import Any

from keras_orbax._src.compat.versions import Private, attribute

_GET_FILE = Private("keras-hub", "keras_hub.src.utils.preset_utils", "get_file")
_CHECK_FILE_EXISTS = Private("keras-hub", "keras_hub.src.utils.preset_utils", "check_file_exists")
_GET_PRESET_LOADER = Private("keras-hub", "keras_hub.src.utils.preset_utils", "get_preset_loader")
_LOADERS = "keras_hub.src.utils.transformers"
_TRANSFORMERS_LOADER = Private("keras-hub", f"{_LOADERS}.preset_loader", "TransformersPresetLoader")
_SAFETENSOR_LOADER = Private("keras-hub", f"{_LOADERS}.safetensor_utils", "SafetensorLoader")
# The methods keras-orbax calls on them (`sources/hub_convert`) or overrides: an override of a
# renamed method would silently never run.
_LOADER_METHODS = [
    Private("keras-hub", f"{_LOADERS}.preset_loader", f"TransformersPresetLoader.{name}")
    for name in ("load_backbone", "check_backbone_class")
] + [
    Private("keras-hub", f"{_LOADERS}.safetensor_utils", f"SafetensorLoader.{name}")
    for name in ("get_prefixed_key", "get_tensor", "port_weight")
]


def downloaded_preset(handle: str) -> Any:
    """The local directory holding a keras-hub preset's config and weights, downloaded by keras-hub.

    Why private: keras-hub resolves `kaggle://`/`hf://` handles in `preset_utils.get_file` only;
    there is no public "download this preset" call. Untested offline.
    """
    import json
    from pathlib import Path

    get_file = _GET_FILE.get()
    directory = Path(get_file(handle, "config.json")).parent
    if _CHECK_FILE_EXISTS.get()(handle, "model.weights.json"):
        index = Path(get_file(handle, "model.weights.json"))
        parts = json.loads(index.read_text())["weight_map"].values()
        for part in {p for files in parts for p in ([files] if isinstance(files, str) else files)}:
            get_file(handle, part)
    else:
        get_file(handle, "model.weights.h5")
    return directory


def hub_preset_loader(directory: str) -> Any:
    """The loader keras-hub's `Backbone.from_preset(directory)` uses.

    Why private: `preset_utils.get_preset_loader` is how `from_preset` tells a Keras preset from a
    Hugging Face or timm directory; for Hugging Face, its `TransformersPresetLoader` picks the
    converter module for the config's `model_type` and builds the backbone config
    (`load_backbone`). keras-hub exports neither; reusing them keeps the mapping keras-hub's own.
    """
    return _GET_PRESET_LOADER.get()(directory)


def hub_is_transformers_loader(loader: Any) -> bool:
    """Why private: see `hub_preset_loader`; `TransformersPresetLoader` is not exported."""
    for method in _LOADER_METHODS:
        method.get()
    return isinstance(loader, _TRANSFORMERS_LOADER.get())


def hub_convert_weights(loader: Any, backbone: Any, recorder: Any) -> None:
    """Runs the converter module that `loader` (a `TransformersPresetLoader`) picked for the
    config's `model_type`, porting its weights through `recorder`.

    Why private: see `hub_preset_loader`; the converter and the Hugging Face config are attributes
    of keras-hub's loader only.
    """
    converter = attribute(loader, "converter", "keras-hub")
    config = attribute(loader, "config", "keras-hub")
    attribute(converter, "convert_weights", "keras-hub")(backbone, recorder, config)


def hub_safetensor_loader_class() -> type:
    """keras-hub's `SafetensorLoader`, the object its converters call `port_weight` on.

    Why private: converters take the loader as an argument and call `port_weight(variable, key,
    hook_fn)`, `get_tensor(key)` and its key-prefix resolution; a subclass that records instead of
    assigning sees exactly the mapping keras-hub would apply. keras-hub does not export the class.
    """
    for method in _LOADER_METHODS:
        method.get()
    return _SAFETENSOR_LOADER.get()


# keras-hub's Hugging Face exporter (`Backbone.export_to_transformers`): its per-model tables and
# the functions that write the non-weight files.
_EXPORTER = "keras_hub.src.utils.transformers.export.hf_exporter"
_HF_CONFIGS = Private("keras-hub", _EXPORTER, "MODEL_CONFIGS")
_HF_WEIGHTS_MAPS = Private("keras-hub", _EXPORTER, "MODEL_EXPORTERS")
_HF_FILE_WRITERS = {
    name: Private("keras-hub", _EXPORTER, name)
    for name in (
        "export_tokenizer",
        "export_image_converter",
        "export_processor_config",
        "export_generation_config",
    )
}


def hf_export_functions(backbone_class: str) -> tuple[Any, Any] | None:
    """keras-hub's `(get_config(backbone), get_weights_map(backbone, include_lm_head))` for a
    backbone class name, or None where keras-hub exports no such model.

    Why private: `export_to_transformers` runs them and then fetches every tensor whole to one host
    (`np.array`), which fails for arrays that span processes and holds whole variables; keras-hub
    exports only the whole call. Calling its per-model functions keeps the names, the tensor
    arithmetic and the config keras-hub's own.
    """
    configs, weights_maps = _HF_CONFIGS.get(), _HF_WEIGHTS_MAPS.get()
    if backbone_class not in configs or backbone_class not in weights_maps:
        return None
    return configs[backbone_class], weights_maps[backbone_class]


def hf_exported_classes() -> list[str]:
    """The backbone class names keras-hub exports to Hugging Face (see `hf_export_functions`)."""
    return sorted(set(_HF_CONFIGS.get()) & set(_HF_WEIGHTS_MAPS.get()))


def hf_write_extra_files(backbone: Any, tokenizer: Any, path: str) -> None:
    """Writes the non-weight files keras-hub's `CausalLM.export_to_transformers` writes (image
    converter, processor and generation configs; the tokenizer's files when given one).

    Why private: keras-hub writes them only inside `export_to_safetensors`, together with the
    weights it gathers (see `hf_export_functions`); these module functions are its own writers.
    """
    writers = {name: symbol.get() for name, symbol in _HF_FILE_WRITERS.items()}
    for name in ("export_image_converter", "export_processor_config", "export_generation_config"):
        writers[name](backbone, path)
    if tokenizer is not None:
        writers["export_tokenizer"](tokenizer, path)


# keras-hub's preset saver (`Backbone.save_to_preset`, `Task.save_to_preset`): the files a preset
# holds and the writers of its config and metadata.
_PRESET_UTILS = "keras_hub.src.utils.preset_utils"
_PRESET_SAVER = Private("keras-hub", _PRESET_UTILS, "KerasPresetSaver")
_PRESET_SAVER_METHODS = [
    Private("keras-hub", _PRESET_UTILS, f"KerasPresetSaver.{name}")
    for name in ("_save_serialized_object", "_save_metadata", "_get_variables_size_in_bytes")
]
_PRESET_FILES = {
    name: Private("keras-hub", _PRESET_UTILS, name)
    for name in (
        "CONFIG_FILE",
        "MODEL_WEIGHTS_FILE",
        "SHARDED_MODEL_WEIGHTS_CONFIG_FILE",
        "TASK_CONFIG_FILE",
        "TASK_WEIGHTS_FILE",
    )
}


def preset_file(name: str) -> str:
    """The name keras-hub gives a preset's file (`CONFIG_FILE`: "config.json", `MODEL_WEIGHTS_FILE`,
    `SHARDED_MODEL_WEIGHTS_CONFIG_FILE`, `TASK_CONFIG_FILE`, `TASK_WEIGHTS_FILE`). Why private:
    `preset_utils` does not export them."""
    return str(_PRESET_FILES[name].get())


def save_preset_config(directory: str, obj: Any, config_file: str, *, metadata: bool) -> None:
    """Writes `obj`'s config (a backbone's or a task's) into the preset `directory` as keras-hub's
    `save_to_preset` writes it, and for a backbone `metadata.json`.

    Why private: keras-hub's `KerasPresetSaver` writes them only inside `save_backbone` and
    `save_task`, which then save the weights with Keras's `save_weights` (each variable fetched
    whole to one host); its two writers, called alone, keep the files keras-hub's own.
    """
    for method in _PRESET_SAVER_METHODS:
        method.get()
    saver = _PRESET_SAVER.get()(directory)
    saver._save_serialized_object(obj, config_file)
    if metadata:
        saver._save_metadata(obj)


def preset_weights_bytes(directory: str, backbone: Any) -> float:
    """The size keras-hub's `save_backbone` compares with `max_shard_size` to decide whether a
    backbone's weights are one `model.weights.h5` or a `model.weights.json` with parts.

    Why private: `KerasPresetSaver._get_variables_size_in_bytes` is that rule (each variable once,
    bits of its dtype); keras-hub does not export it.
    """
    for method in _PRESET_SAVER_METHODS:
        method.get()
    return float(_PRESET_SAVER.get()(directory)._get_variables_size_in_bytes(backbone.variables))
