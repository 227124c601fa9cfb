"""GPTQ and AWQ (Keras's calibrated, post-training quantization modes): a quantized model saved and
restored into a second quantized build holds exactly the saved state and gives the same outputs."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_orbax

VOCAB = 64
WIDTH = 32  # GPTQ compiles a step per column: a narrow model keeps it to seconds


class _Tokenizer:
    """Characters to ids: what the calibration loader needs of a tokenizer."""

    def tokenize(self, text):
        return [ord(c) % VOCAB for c in "".join(text)]

    def __call__(self, text):
        return self.tokenize(text)


class _Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(WIDTH)

    def call(self, x):
        return self.dense(x)


def _quantized(mode: str, seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.layers.Embedding(VOCAB, WIDTH), _Block(), _Block()])
    model.build((None, 10))
    structure = {"pre_block_layers": [model.layers[0]], "sequential_blocks": model.layers[1:]}
    config_class = keras.quantizers.GPTQConfig if mode == "gptq" else keras.quantizers.AWQConfig
    config = config_class(
        dataset=["some calibration text for the test"],
        tokenizer=_Tokenizer(),
        group_size=16,
        quantization_layer_structure=structure,
        num_samples=4,
        sequence_length=10,
    )
    model.quantize(mode, config=config)
    return model


@pytest.mark.parametrize("mode", ["gptq", "awq"])
def test_calibrated_quantized_models_restore_exactly(tmp_path, mode):
    source = _quantized(mode, seed=0)
    assert any(v.dtype == "uint8" for v in source.weights)  # packed quantized kernels
    keras_orbax.save(source, tmp_path, step=1)
    target = _quantized(mode, seed=1)  # other values, the same structure
    result = keras_orbax.restore_sharded(target, tmp_path)
    assert len(result.restored) == len(source.weights) and not result.skipped
    for want, got in zip(source.weights, target.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value))
    x = np.arange(20).reshape(2, 10) % VOCAB
    np.testing.assert_array_equal(np.asarray(target(x)), np.asarray(source(x)))
