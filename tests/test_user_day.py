"""A new user's day (issue 37): each thing that went wrong when keras-orbax was tried from the
README and the docs, as a test of what a user now gets."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_orbax
from keras_orbax._src.tools.plan_report import plan_restore_report
from tests import cli_models

STEPS = (4, 8, 12)


@pytest.fixture(name="ckpt")
def _ckpt(tmp_path):
    model = cli_models.mlp()
    for step in STEPS:
        keras_orbax.save(model, tmp_path / "ckpt", step=step)
    return tmp_path / "ckpt"


VERBS = {
    "save": lambda m, d, step: keras_orbax.save(m, d, step=step),
    "restore_sharded": lambda m, d, step: keras_orbax.restore_sharded(m, d, step=step),
    "load_model": lambda m, d, step: keras_orbax.load_model(d, step=step),
    "inspect": lambda m, d, step: keras_orbax.inspect(d, step=step),
    "verify": lambda m, d, step: keras_orbax.verify(d, step=step),
    "plan": lambda m, d, step: plan_restore_report(m, d, step),
}


@pytest.mark.parametrize("verb", VERBS)
def test_a_step_given_as_a_string_gets_one_type_error_in_every_verb(ckpt, verb):
    """`step="8"` (read from argv) had every reading verb say "Step 8 is not a committed step
    ... Committed steps: [4, 8, 12]"; `save` a TypeError. Now each says the same."""
    with pytest.raises(TypeError) as raised:
        VERBS[verb](cli_models.mlp(), ckpt, "8")
    assert str(raised.value) == (
        "step must be an integer (it names the step's directory), not a string: pass "
        "step=int('8'). Received: step='8'"
    )


@pytest.mark.parametrize("step", [8.0, True], ids=["float", "bool"])
@pytest.mark.parametrize("verb", ["restore_sharded", "inspect"])
def test_a_step_that_is_no_integer_is_refused_as_save_refuses_it(ckpt, verb, step):
    with pytest.raises(TypeError, match=r"step must be an integer .*Received: step=(8\.0|True)$"):
        VERBS[verb](cli_models.mlp(), ckpt, step)


@pytest.mark.parametrize(
    "step",
    [np.int64(8), np.array(8), keras.Variable(8, dtype="int32")],
    ids=["numpy", "0-d array", "variable"],
)
def test_an_integer_step_of_any_kind_names_the_step(ckpt, step):
    model = cli_models.mlp()
    assert keras_orbax.restore_sharded(model, ckpt, step=step).step == 8
    assert keras_orbax.inspect(ckpt, step=step).step == 8
