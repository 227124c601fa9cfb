"""Hugging Face safetensors directories written by keras-hub, mapped onto keras-hub backbones.

The oracle is keras-hub's own `from_preset` on the same directory: every value `host_value` computes
must equal, exactly, what keras-hub puts in that variable.
"""

from __future__ import annotations

import json
import re
import shutil
import types

import jax
import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.compat import hub_compat
from keras_orbax._src.sources import hub_convert, safetensors_files
from keras_orbax._src.sources.hub_hooks import HookKind, classify
from keras_orbax.errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from tests._hf_export import GEMMA
from tests._hub import import_keras_hub

keras_hub = import_keras_hub()
safetensors = import_keras_hub("safetensors")
safetensors_numpy = import_keras_hub("safetensors.numpy")

LLAMA = dict(
    vocabulary_size=64,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=16,
    intermediate_dim=32,
    tie_word_embeddings=True,  # keras-hub's export leaves out lm_head
)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    keras_hub.models.Llama3Backbone(**LLAMA).export_to_transformers(str(directory))
    return directory


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma")
    keras_hub.models.GemmaBackbone(**GEMMA).export_to_transformers(str(directory))
    return directory


@pytest.fixture(scope="module")
def sharded_llama_dir(tmp_path_factory, llama_dir):
    """The Llama export split into two part files plus `model.safetensors.index.json`."""
    directory = tmp_path_factory.mktemp("llama_sharded")
    shutil.copy(llama_dir / "config.json", directory / "config.json")
    tensors = safetensors_numpy.load_file(llama_dir / safetensors_files.SINGLE_FILE)
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2]}
    parts["model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for part, part_names in parts.items():
        safetensors_numpy.save_file({n: tensors[n] for n in part_names}, directory / part)
        weight_map.update(dict.fromkeys(part_names, part))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}}
    index["weight_map"] = weight_map
    (directory / safetensors_files.INDEX_FILE).write_text(json.dumps(index))
    return directory


CASES = {
    "llama3": ("llama_dir", keras_hub.models.Llama3Backbone, {}),
    "llama3_sharded": ("sharded_llama_dir", keras_hub.models.Llama3Backbone, {}),
    "gemma_bf16": ("gemma_dir", keras_hub.models.GemmaBackbone, {"dtype": "bfloat16"}),
}


@pytest.fixture(params=list(CASES))
def case(request):
    fixture, cls, kwargs = CASES[request.param]
    return request.getfixturevalue(fixture), cls, kwargs


def _ported(directory, kwargs):
    backbone = hub_convert.build_backbone(directory, **kwargs)
    return backbone, hub_convert.port_tensors(backbone, directory)


def test_ported_tensors_give_keras_hub_values(case):
    directory, cls, kwargs = case
    expected = cls.from_preset(str(directory), **kwargs)  # keras-hub's own loader
    backbone, ported = _ported(directory, kwargs)
    assert type(backbone) is cls
    assert hub_convert.unported_variables(backbone, ported) == []
    position = {id(v): i for i, v in enumerate(backbone.variables)}
    assert sorted(position[id(p.variable)] for p in ported) == list(range(len(position)))
    for p in ported:
        want = np.asarray(expected.variables[position[id(p.variable)]].value)
        got = hub_convert.host_value(p)
        assert got.dtype == want.dtype, p.variable.path
        np.testing.assert_array_equal(got, want, err_msg=p.variable.path)


def test_ports_a_deferred_backbone_without_allocating(llama_dir, distribution):
    mesh = keras.distribution.DeviceMesh((4, 2), ("batch", "model"), jax.devices())
    layout_map = keras_hub.models.Llama3Backbone.get_layout_map(mesh)
    distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    with keras_orbax.deferred_init():
        built = hub_convert.build_backbone(llama_dir)
        # What `keras_orbax.from_preset` builds: keras-hub's own path without weights.
        from_preset = keras_hub.models.Backbone.from_preset(str(llama_dir), load_weights=False)
    for backbone in (built, from_preset):
        ported = hub_convert.port_tensors(backbone, llama_dir)
        assert hub_convert.unported_variables(backbone, ported) == []
        assert all(v._value is None for v in backbone.variables)


def test_hook_plans_reproduce_the_hooks(case):
    """Every plan, applied to the raw tensor, gives exactly what the hook gives."""
    directory, _, kwargs = case
    _, ported = _ported(directory, kwargs)
    for p in ported:
        plan = hub_convert.classify_hook(p)
        assert plan.kind is not HookKind.OTHER, (p.variable.path, plan.reason)
        assert plan.shape == tuple(p.variable.shape)
        raw = safetensors_files.read_tensor(p.tensor)
        value = raw.reshape(plan.view_shape).transpose(plan.permutation).reshape(plan.shape)
        for dtype in plan.casts:
            value = value.astype(dtype)
        np.testing.assert_array_equal(
            value.astype(hub_convert.host_value(p).dtype),
            hub_convert.host_value(p),
            err_msg=p.variable.path,
        )


def _plans(directory, kwargs=None):
    _, ported = _ported(directory, kwargs or {})
    return {p.tensor.name: hub_convert.classify_hook(p) for p in ported}


def test_llama3_hook_kinds(llama_dir):
    plans = _plans(llama_dir)
    identity = plans["model.layers.0.input_layernorm.weight"]
    assert identity.kind is HookKind.IDENTITY and identity.permutation == (0,)
    assert plans["model.embed_tokens.weight"].kind is HookKind.IDENTITY
    gate = plans["model.layers.0.mlp.gate_proj.weight"]
    assert (gate.kind, gate.permutation) == (HookKind.TRANSPOSE, (1, 0))
    # q_proj (heads * head_dim, hidden) -> (hidden, heads, head_dim); o_proj the other way.
    q = plans["model.layers.0.self_attn.q_proj.weight"]
    assert (q.kind, q.view_shape, q.permutation) == (HookKind.REARRANGE, (4, 4, 16), (2, 0, 1))
    k = plans["model.layers.1.self_attn.k_proj.weight"]
    assert (k.view_shape, k.shape) == ((2, 4, 16), (16, 2, 4))
    o = plans["model.layers.0.self_attn.o_proj.weight"]
    assert (o.kind, o.view_shape, o.permutation) == (HookKind.REARRANGE, (16, 4, 4), (1, 2, 0))


def test_gemma_hook_kinds(gemma_dir):
    plans = _plans(gemma_dir, {"dtype": "bfloat16"})
    assert plans["model.norm.weight"].kind is HookKind.IDENTITY
    down = plans["model.layers.1.mlp.down_proj.weight"]
    assert (down.kind, down.permutation) == (HookKind.TRANSPOSE, (1, 0))
    # q_proj (heads * head_dim, hidden) -> (heads, hidden, head_dim).
    q = plans["model.layers.0.self_attn.q_proj.weight"]
    assert (q.kind, q.view_shape, q.permutation) == (HookKind.REARRANGE, (4, 8, 32), (0, 2, 1))
    # k_proj (head_dim, hidden) -> (1, hidden, head_dim): a transpose plus a unit axis.
    k = plans["model.layers.0.self_attn.k_proj.weight"]
    assert (k.view_shape, k.permutation, k.shape) == ((8, 32), (1, 0), (1, 32, 8))


def test_sharded_directory_parses_like_the_single_file(llama_dir, sharded_llama_dir):
    single = safetensors_files.read_directory(llama_dir)
    sharded = safetensors_files.read_directory(sharded_llama_dir)
    assert sorted(single) == sorted(sharded)
    assert len({t.file for t in sharded.values()}) == 2
    for name, tensor in single.items():
        assert (sharded[name].shape, sharded[name].dtype) == (tensor.shape, tensor.dtype)
        want = safetensors_files.read_tensor(tensor)
        np.testing.assert_array_equal(safetensors_files.read_tensor(sharded[name]), want)


def test_offsets_match_the_safetensors_package(gemma_dir):
    tensors = safetensors_files.read_directory(gemma_dir)
    assert tensors["model.embed_tokens.weight"].dtype == np.dtype("bfloat16")
    raw = (gemma_dir / safetensors_files.SINGLE_FILE).read_bytes()
    # `safe_open` is what keras-hub reads with (`safetensors.numpy.load` has no BF16).
    with safetensors.safe_open(gemma_dir / safetensors_files.SINGLE_FILE, framework="np") as f:
        for name, tensor in tensors.items():
            want = np.ascontiguousarray(f.get_tensor(name))
            assert (want.shape, want.dtype) == (tensor.shape, tensor.dtype), name
            assert raw[tensor.offset : tensor.offset + tensor.nbytes] == want.tobytes(), name


def test_host_value_reads_only_its_own_bytes(tmp_path, llama_dir):
    directory = tmp_path / "garbled"
    shutil.copytree(llama_dir, directory)
    _, ported = _ported(directory, {})
    target = next(p for p in ported if p.tensor.name.endswith("0.self_attn.o_proj.weight"))
    want = hub_convert.host_value(target)
    with open(directory / safetensors_files.SINGLE_FILE, "r+b") as f:
        for p in ported:
            if p is not target:
                f.seek(p.tensor.offset)
                f.write(b"\xff" * p.tensor.nbytes)
    np.testing.assert_array_equal(hub_convert.host_value(target), want)


def test_classify_synthetic_hooks():
    f32 = np.dtype("float32")
    cast = classify(lambda x, _: x.astype(np.float16), (4, 6), f32, [4, 6])
    assert (cast.kind, cast.casts) == (HookKind.IDENTITY, (np.dtype("float16"),))
    reshape = classify(lambda x, s: np.reshape(x, s), (4, 6), f32, [2, 2, 6])
    assert (reshape.kind, reshape.view_shape) == (HookKind.RESHAPE, (2, 2, 6))
    scaled = classify(lambda x, _: x * 2, (4, 6), f32, [4, 6])
    assert scaled.kind is HookKind.OTHER and "mul" in scaled.reason
    untraceable = classify(lambda x, _: np.asarray(x), (4, 6), f32, [4, 6])
    assert untraceable.kind is HookKind.OTHER and "not traceable" in untraceable.reason
    constant = classify(lambda x, s: np.zeros(s, "float32"), (4, 6), f32, [4, 6])
    assert constant.kind is HookKind.OTHER


def test_bad_directories(tmp_path, llama_dir):
    with pytest.raises(CheckpointNotFoundError, match=r"neither model\.safetensors"):
        safetensors_files.read_directory(tmp_path)
    data = (llama_dir / safetensors_files.SINGLE_FILE).read_bytes()
    (tmp_path / safetensors_files.SINGLE_FILE).write_bytes(data[:-4])
    with pytest.raises(CorruptCheckpointError, match="data_offsets"):
        safetensors_files.read_directory(tmp_path)
    (tmp_path / safetensors_files.INDEX_FILE).write_text(
        '{"weight_map": {"a": "part.safetensors"}}'
    )
    with pytest.raises(CheckpointNotFoundError, match=r"names part\.safetensors"):
        safetensors_files.read_directory(tmp_path)
    keras_preset = tmp_path / "keras_preset"  # what `save_to_preset` writes: a Keras config
    keras_preset.mkdir()
    (keras_preset / "config.json").write_text('{"registered_name": "keras_hub>GemmaBackbone"}')
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        hub_convert.build_backbone(keras_preset)


def test_converter_using_tensor_values_is_refused(llama_dir, monkeypatch):
    """Probing for a key works (keras-hub's Gemma3/BERT converters do); using its values does not."""
    loader = hub_compat.hub_preset_loader(str(llama_dir))

    def convert_weights(backbone, recorder, config):
        with pytest.raises(KeyError, match="no tensor"):
            recorder.get_tensor("lm_head.weight")
        np.transpose(recorder.get_tensor("model.norm.weight"))

    monkeypatch.setattr(loader, "converter", types.SimpleNamespace(convert_weights=convert_weights))
    monkeypatch.setattr(hub_compat, "hub_preset_loader", lambda directory: loader)
    with pytest.raises(NotImplementedError, match=r"model\.norm\.weight"):
        hub_convert.port_tensors(keras.Sequential(), llama_dir)


# A config.json edited (or taken from another size of the model) beside the original tensors.
# keras-hub's own loader fails on these with a NumPy reshape error or safetensors' "File does not
# contain tensor"; keras-orbax says which tensor, which variable, and both shapes.
CONFIG_EDITS = {
    # A transposed tensor: the line shows it as converted, the hint as stored.
    "intermediate_size": (64, [r"model\.layers\.0\.mlp\.down_proj\.weight \(16, 32\)",
                               r"decoder_block_0/ffw_linear/kernel \(64, 32\)",
                               r"down_proj\.weight is stored as \(32, 16\)"]),
    # A reshaping hook that the sizes cannot satisfy: shown as stored.
    "num_attention_heads": (8, [r"model\.layers\.0\.self_attn\.q_proj\.weight \(32, 32\)",
                                r"decoder_block_0/attention/query/kernel \(8, 32, 8\)"]),
    # A tensor the converter asks for that the files lack.
    "num_hidden_layers": (3, [r"no tensor 'model\.layers\.2\.input_layernorm\.weight'",
                              r"reads into decoder_block_2/pre_attention_norm/scale \(32,\)"]),
}  # fmt: skip


@pytest.mark.parametrize("field", list(CONFIG_EDITS))
def test_a_config_that_does_not_describe_the_tensors_names_both_sides(tmp_path, gemma_dir, field):
    value, patterns = CONFIG_EDITS[field]
    directory = tmp_path / "edited"
    shutil.copytree(gemma_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config[field] = value
    (directory / "config.json").write_text(json.dumps(config))

    with pytest.raises(CheckpointMismatchError) as raised:
        keras_orbax.from_preset(keras_hub.models.GemmaBackbone, directory, dtype="bfloat16")
    for pattern in patterns:
        assert re.search(pattern, str(raised.value)), str(raised.value)

    # A model built from that config is left as it was.
    model = hub_convert.build_backbone(directory, dtype="bfloat16")
    before = [np.asarray(v.value) for v in model.variables]
    with pytest.raises(CheckpointMismatchError):
        keras_orbax.restore_sharded(model, directory)
    for variable, value_before in zip(model.variables, before, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), value_before)
