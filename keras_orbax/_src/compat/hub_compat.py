"""Private keras-hub symbols, each wrapped with why no public API serves. keras-hub is an optional
extra: each is imported only when called.

Checked against keras-hub 0.32.0; the tests that have keras-hub exercise every one of them.
"""

from __future__ import annotations

from typing import Any


def downloaded_preset(handle: str) -> Any:
    """The local directory holding a keras-hub preset's config and weights, downloaded by keras-hub.

    Why private: keras-hub resolves `kaggle://`/`hf://` handles in `preset_utils.get_file` only;
    there is no public "download this preset" call. Untested offline.
    """
    import json
    from pathlib import Path

    from keras_hub.src.utils import preset_utils

    directory = Path(preset_utils.get_file(handle, "config.json")).parent
    if preset_utils.check_file_exists(handle, "model.weights.json"):
        index = Path(preset_utils.get_file(handle, "model.weights.json"))
        parts = json.loads(index.read_text())["weight_map"].values()
        for part in {p for files in parts for p in ([files] if isinstance(files, str) else files)}:
            preset_utils.get_file(handle, part)
    else:
        preset_utils.get_file(handle, "model.weights.h5")
    return directory


def hub_preset_loader(directory: str) -> Any:
    """The loader keras-hub's `Backbone.from_preset(directory)` uses.

    Why private: `preset_utils.get_preset_loader` is how `from_preset` tells a Keras preset from a
    Hugging Face or timm directory; for Hugging Face, its `TransformersPresetLoader` picks the
    converter module for the config's `model_type` and builds the backbone config
    (`load_backbone`). keras-hub exports neither; reusing them keeps the mapping keras-hub's own.
    """
    from keras_hub.src.utils.preset_utils import get_preset_loader

    return get_preset_loader(directory)


def hub_is_transformers_loader(loader: Any) -> bool:
    """Why private: see `hub_preset_loader`; `TransformersPresetLoader` is not exported."""
    from keras_hub.src.utils.transformers.preset_loader import TransformersPresetLoader

    return isinstance(loader, TransformersPresetLoader)


def hub_safetensor_loader_class() -> type:
    """keras-hub's `SafetensorLoader`, the object its converters call `port_weight` on.

    Why private: converters take the loader as an argument and call `port_weight(variable, key,
    hook_fn)`, `get_tensor(key)` and its key-prefix resolution; a subclass that records instead of
    assigning sees exactly the mapping keras-hub would apply. keras-hub does not export the class.
    """
    from keras_hub.src.utils.transformers.safetensor_utils import SafetensorLoader

    return SafetensorLoader
