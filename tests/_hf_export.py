"""Tiny keras-hub models for the Hugging Face export tests and their multi-process worker."""

from __future__ import annotations

import dataclasses

import jax
import keras
import numpy as np

# Export window in bytes: the larger variables (2-4 KiB) are cut into several windows each, every
# one written as its own runs (smaller windows only add calls: 64 took 3x as long).
WINDOW = 256

# keras-hub's Gemma export takes key/value kernels as `kernel[0]` (one key/value head) and assumes
# heads * head_dim == hidden_dim; bfloat16 covers BF16 headers.
GEMMA = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=1,
    hidden_dim=32,
    intermediate_dim=32,
    head_dim=8,
    dtype="bfloat16",
)
# hidden_dim != heads * head_dim (as in Gemma2 9B: 3584 against 16 x 256) and two key/value heads:
# keras-hub's exporter reshapes the query kernel across axes and slices the first key/value head.
GEMMA_SPLIT = dict(GEMMA, hidden_dim=24, num_key_value_heads=2)
# Untied embeddings: a CausalLM export writes `lm_head.weight` too.
LLAMA3 = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
    tie_word_embeddings=False,
)


def backbone_class(name: str) -> type:
    import keras_hub

    return getattr(keras_hub.models, _CLASSES[name] + "Backbone")


def causal_lm_class(name: str) -> type:
    import keras_hub

    return getattr(keras_hub.models, _CLASSES[name] + "CausalLM")


_CLASSES = {
    "gemma": "Gemma",
    "gemma3": "Gemma3",
    "gpt2": "GPT2",
    "llama3": "Llama3",
    "mistral": "Mistral",
    "qwen": "Qwen",
}


def keras_hubs_export(backbone: keras.Model, directory: str) -> None:
    """keras-hub's own export of `backbone`; of one with untied embeddings, its CausalLM's (the same
    files with `lm_head.weight`), as keras-orbax writes a backbone whose LM head is its own."""
    import keras_hub

    if backbone.get_layer("token_embedding").tie_weights:
        backbone.export_to_transformers(directory)
        return
    task_class = {keras_hub.models.Llama3Backbone: keras_hub.models.Llama3CausalLM}[type(backbone)]
    task_class(backbone=backbone, preprocessor=None).export_to_transformers(directory)


def config(name: str) -> dict:
    return {"gemma": GEMMA, "llama3": LLAMA3}[name]


def model_parallel(
    name: str, mesh_shape: tuple[int, int] = (2, 4), model_config: dict | None = None
) -> keras.distribution.Distribution:
    """keras-hub's own layout map on a `("batch", "model")` mesh of every device.

    Gemma's key/value heads where "model" does not divide them (the default config's single one)
    cannot be split over it: its key/value kernels are split along the hidden axis instead.
    """
    mesh = keras.distribution.DeviceMesh(mesh_shape, ("batch", "model"), jax.devices())
    if not hasattr(backbone_class(name), "get_layout_map"):  # keras-hub has none: replicated
        return keras.distribution.DataParallel(devices=jax.devices())
    layout_map = backbone_class(name).get_layout_map(mesh)
    key_value_heads = (model_config or config(name)).get("num_key_value_heads", 1)
    if name == "gemma" and key_value_heads % mesh_shape[1]:
        query_key_value = "decoder_block.*attention.*(query|key|value).kernel"
        layout_map["decoder_block.*attention.*query.kernel"] = layout_map.pop(query_key_value)
        layout_map["decoder_block.*attention.*(key|value).kernel"] = (None, "model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def fill(model: keras.Model, seed: int = 0) -> None:
    """Deterministic values for every variable (the same on every process)."""
    rng = np.random.default_rng(seed)
    for variable in model.variables:
        if variable.path.endswith("seed_generator_state"):
            continue
        values = rng.standard_normal(tuple(variable.shape)).astype("float32")
        variable.assign(values.astype(variable.dtype))


def llama3_tokenizer() -> keras.layers.Layer:
    """A Llama3 BPE tokenizer of 64 tokens: enough for keras-hub to write and read its files."""
    import keras_hub

    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
    vocabulary = {token: i for i, token in enumerate([*special, "<|eot_id|>", "a", "b", "ab"])}
    vocabulary.update({f"t{i}": i for i in range(len(vocabulary), 64)})
    return keras_hub.models.Llama3Tokenizer(vocabulary=vocabulary, merges=["a b"])


def train_one_step(model: keras.Model, seed: int = 1) -> None:
    """One SGD step of a CausalLM (no preprocessor) on fixed tokens."""
    rng = np.random.default_rng(seed)
    vocabulary = model.backbone.vocabulary_size
    tokens = rng.integers(0, vocabulary, size=(2, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((2, 8), "int32")}
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    model.train_on_batch(x, tokens[:, 1:])


def exported_arrays(backbone: keras.Model) -> dict[str, jax.Array]:
    """The values each variable of a backbone without LoRA should get from an export of
    `backbone`: its variables, with each LoRA layer's kernel merged as the layer computes it."""
    values = {}
    for layer in backbone._flatten_layers(include_self=False):
        if getattr(layer, "lora_enabled", False):
            # A model without LoRA stores the merge in the kernel's dtype (keras-hub's loader
            # casts each tensor to its variable's).
            values[layer._kernel.path] = keras.ops.cast(layer.kernel, layer._kernel.dtype)
    for variable in backbone.variables:
        if "lora_kernel" not in variable.path and variable.path not in values:
            values[variable.path] = variable.value
    return values


def exported_values(backbone: keras.Model) -> dict[str, np.ndarray]:
    """`exported_arrays` on the host (single process)."""
    return {path: np.asarray(value) for path, value in exported_arrays(backbone).items()}


@dataclasses.dataclass(frozen=True)
class ExportCase:
    """One cell of docs/exporting.md's export support table: a tiny keras-hub CausalLM of one
    architecture and layout, with or without LoRA, exported from a (2, 4) mesh. `refused` holds
    what the refusal names, else the export must read back exactly."""

    architecture: str  # "gemma", "llama3"
    key: str  # the layout, in a test id
    layout: str  # the layout, as the table words it
    config: dict
    lora: bool
    refused: str | None = None
    # keras-hub's loader rounds every tensor through this dtype (`convert_mistral`: float16)
    loaded_as: str | None = None

    @property
    def id(self) -> str:
        return f"{self.architecture}-{self.key}-{'lora' if self.lora else 'full'}"


_GEMMA_CASE = dict(GEMMA, dtype="float32")  # float32: transformers' logits compare tightly
_LLAMA3_CASE = dict(LLAMA3, dtype="float32")
_SMALL = dict(vocabulary_size=64, num_layers=2, hidden_dim=16, dtype="float32")
_LAYOUTS = [
    ("gemma", "mqa", "1 key/value head, hidden = heads x head_dim (Gemma 2B)", _GEMMA_CASE, None),
    (
        "gemma",
        "mha",
        "key/value heads = query heads, hidden = heads x head_dim",
        dict(_GEMMA_CASE, num_key_value_heads=4),
        None,
    ),
    (
        "gemma",
        "mha_narrow",
        "key/value heads = query heads, hidden != heads x head_dim (Gemma 7B)",
        dict(_GEMMA_CASE, num_key_value_heads=4, hidden_dim=24),
        None,
    ),
    (
        "gemma",
        "gemma2",
        "Gemma 2's options (post norms, soft caps, sliding window)",
        dict(
            _GEMMA_CASE,
            use_post_ffw_norm=True,
            use_post_attention_norm=True,
            final_logit_soft_cap=30.0,
            attention_logit_soft_cap=50.0,
            use_sliding_window_attention=True,
        ),
        "use_post_ffw_norm=True, use_post_attention_norm=True",
    ),
    ("llama3", "untied", "untied embeddings, 2 key/value heads of 4", _LLAMA3_CASE, None),
    ("llama3", "tied", "tied embeddings", dict(_LLAMA3_CASE, tie_word_embeddings=True), None),
    (
        "gemma3",
        "text",
        "text only, 2 key/value heads of 4",
        dict(
            _GEMMA_CASE,
            num_key_value_heads=2,
            image_size=16,
            use_post_ffw_norm=True,
            use_post_attention_norm=True,
            vision_encoder=None,
        ),
        None,
    ),
    (
        "gemma3",
        "no_post_norms",
        "without post norms",
        dict(_GEMMA_CASE, image_size=16, vision_encoder=None),
        "use_post_ffw_norm=False, use_post_attention_norm=False",
    ),
    (
        "gpt2",
        "mha",
        "intermediate = 4 x hidden",
        dict(_SMALL, num_heads=4, intermediate_dim=64, max_sequence_length=16),
        None,
    ),
    (
        "mistral",
        "gqa",
        "2 key/value heads of 4",
        dict(
            _SMALL, num_query_heads=4, num_key_value_heads=2, intermediate_dim=32, sliding_window=8
        ),
        None,
    ),
    (
        "qwen",
        "gqa",
        "2 key/value heads of 4, tied embeddings",
        dict(_SMALL, num_query_heads=4, num_key_value_heads=2, intermediate_dim=32),
        None,
    ),
]
EXPORT_CASES = [
    ExportCase(
        architecture,
        key,
        layout,
        model_config,
        lora,
        refused,
        loaded_as="float16" if architecture == "mistral" else None,
    )
    for architecture, key, layout, model_config, refused in _LAYOUTS
    for lora in (False, True)
]


def support_table(cases: list[ExportCase]) -> str:
    """The markdown table of `cases`: one row per architecture and layout."""
    names = {
        "gemma": "Gemma",
        "gemma3": "Gemma 3",
        "gpt2": "GPT-2",
        "llama3": "Llama 3",
        "mistral": "Mistral",
        "qwen": "Qwen",
    }
    rows = {}
    for case in cases:
        outcome = "refused" if case.refused else "exact"
        rows.setdefault((case.architecture, case.layout), {})[case.lora] = outcome
    lines = ["| architecture | layout | without LoRA | with LoRA |", "| --- | --- | --- | --- |"]
    for (architecture, layout), outcome in rows.items():
        lines.append(f"| {names[architecture]} | {layout} | {outcome[False]} | {outcome[True]} |")
    return "\n".join(lines)
