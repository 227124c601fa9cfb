"""Where keras-hub 0.32's exporters write files their readers refuse or misread: the files
corrected, or the export refused, never written wrong.

- Its Gemma exporter (`get_gemma_weights_map`) is right only in Gemma 2B's layout (one key/value
  head, `hidden_dim == num_query_heads * head_dim`): with more key/value heads it writes the first
  one only (`weights[0][0]`), and otherwise it reshapes the query kernel where a transpose is due.
  Here the three projections are written as keras-hub's own Hugging Face loader reads them.
- Its Gemma config names transformers' `gemma` model, which has none of Gemma 2's options (post
  norms, soft caps, a sliding window) nor another norm epsilon, and its Gemma 3 config names
  `gemma3`, which always has both post norms: a backbone that differs is refused.
- A backbone's export leaves out its LM head, also where the head is a variable of the backbone
  (untied embeddings: `reverse_embeddings`) and the config names a `...ForCausalLM`: keras-hub's
  loader then refuses the files and transformers initializes a random head. Here it is written.
- Its Qwen config leaves out the sliding window settings its own loader reads (`hf_config`).
- Some backbones' `get_config()` drop a constructor argument they keep (`Llama3Backbone`:
  `tie_word_embeddings`), so a preset's `config.json` rebuilds another model than was saved:
  `complete_preset_config` puts it back.

LoRA is merged for every exporter by `hub_tensors.trace_tensors`.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras

from keras_orbax.errors import UnsupportedSourceError

WeightsMap = Callable[..., dict[str, Any]]

# Per backbone class, the arguments whose value transformers' model of it fixes (keras-hub's
# config names none of them), and that model: Gemma has no post norms, soft caps or sliding window
# and a norm epsilon of 1e-06; Gemma 3 always has both post norms.
_FIXED_BY_TRANSFORMERS: dict[str, tuple[str, dict[str, Any]]] = {
    "GemmaBackbone": (
        "gemma",
        {
            "query_head_dim_normalize": True,
            "use_post_ffw_norm": False,
            "use_post_attention_norm": False,
            "attention_logit_soft_cap": None,
            "final_logit_soft_cap": None,
            "use_sliding_window_attention": False,
            "layer_norm_epsilon": 1e-6,
        },
    ),
    "Gemma3Backbone": ("gemma3", {"use_post_ffw_norm": True, "use_post_attention_norm": True}),
}


def weights_map(backbone: keras.Model, keras_hubs: WeightsMap) -> WeightsMap:
    """keras-hub's `get_*_weights_map` for `backbone`, corrected where it is wrong; raises
    `UnsupportedSourceError` where the export cannot describe the model."""
    class_name = type(backbone).__name__
    if class_name in _FIXED_BY_TRANSFORMERS:
        model_type, fixed = _FIXED_BY_TRANSFORMERS[class_name]
        config = backbone.get_config()
        differ = {k: config[k] for k, v in fixed.items() if k in config and config[k] != v}
        if differ:
            given = ", ".join(f"{k}={v!r}" for k, v in differ.items())
            needs = ", ".join(f"{k}={v!r}" for k, v in fixed.items())
            raise UnsupportedSourceError(
                f"Cannot export {backbone.name!r} to Hugging Face format: keras-hub writes a "
                f"{class_name} as transformers' `{model_type}` model, which cannot express "
                f"{given} (it computes as {needs}); the files would load and compute something "
                "else. Nothing was written. Save it as a keras-hub preset instead: "
                "`keras_orbax.save_to_preset(model, directory)`."
            )
    if class_name != "GemmaBackbone":
        return keras_hubs

    def gemma(backbone: keras.Model, include_lm_head: bool = False) -> dict[str, Any]:
        weights = keras_hubs(backbone, include_lm_head=include_lm_head)
        for i in range(backbone.num_layers):
            attention = backbone.get_layer(f"decoder_block_{i}").attention
            projections = {
                "q_proj": attention.query_dense,
                "k_proj": attention.key_dense,
                "v_proj": attention.value_dense,
            }
            for name, dense in projections.items():
                # (heads, hidden, head_dim) -> (heads * head_dim, hidden), as keras-hub's loader
                # (`convert_gemma`) and transformers read it
                kernel = keras.ops.transpose(dense.kernel, (0, 2, 1))
                weights[f"model.layers.{i}.self_attn.{name}.weight"] = keras.ops.reshape(
                    kernel, (-1, backbone.hidden_dim)
                )
        return weights

    return gemma


def hf_config(backbone: keras.Model, config: dict[str, Any]) -> dict[str, Any]:
    """keras-hub's Hugging Face `config` of `backbone`, with what its own loader needs to rebuild
    it: keras-hub's Qwen config leaves out `use_sliding_window` and `sliding_window`, which its
    loader (`convert_qwen`) reads."""
    if type(backbone).__name__ == "QwenBackbone":
        backbone_config = backbone.get_config()
        return {
            **config,
            "use_sliding_window": backbone_config["use_sliding_window_attention"],
            "sliding_window": backbone_config["sliding_window_size"],
        }
    return config


def has_untied_lm_head(backbone: keras.Model) -> bool:
    """Whether `backbone` holds an LM head of its own (untied reverse embeddings)."""
    return any(v.path.endswith("/reverse_embeddings") for v in backbone.variables)


def complete_preset_config(path: Path, backbone: keras.Model) -> None:
    """Adds to the preset config file `path` (keras-hub's `config.json` or `task.json`) each
    argument of `backbone`'s constructor that its `get_config()` dropped, where `backbone` keeps
    it under the argument's name with a value other than the default: so that the config rebuilds
    the model saved. The file is rewritten only if one was dropped."""
    serialized = json.loads(path.read_text())
    found = _serialized(serialized, type(backbone).__name__)
    if found is None:
        return
    config = found["config"]
    dropped = {}
    for name, parameter in inspect.signature(type(backbone).__init__).parameters.items():
        if name in config or parameter.default is inspect.Parameter.empty:
            continue
        value = getattr(backbone, name, parameter.default)
        if isinstance(value, bool | int | float | str) and value != parameter.default:
            dropped[name] = value
    if dropped:
        config.update(dropped)
        path.write_text(json.dumps(serialized, indent=4))  # as keras-hub writes it


def _serialized(tree: Any, class_name: str) -> dict[str, Any] | None:
    """The serialized object of class `class_name` in a Keras serialization `tree`."""
    if isinstance(tree, dict):
        if tree.get("class_name") == class_name and isinstance(tree.get("config"), dict):
            return tree
        children = list(tree.values())
    elif isinstance(tree, list):
        children = tree
    else:
        return None
    for child in children:
        if (found := _serialized(child, class_name)) is not None:
            return found
    return None
