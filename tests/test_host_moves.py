"""`host_moves`: a traced chain of byte moves of one sharded array, fetched and replayed on the
host with NumPy, against JAX's own result of the same operations (bit for bit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from keras_orbax._src.export import host_moves, hub_tensors

# (name, operations on a (4 heads, 24 hidden, 8 head_dim) kernel, elements the fetch holds)
CHAINS = [
    # keras-hub's Gemma query projection where hidden != heads * head_dim: a reshape that splits
    # axes, after a transpose the fetch absorbs (the reshape is then a view)
    ("query", lambda x: jnp.transpose(jnp.reshape(jnp.transpose(x, (1, 0, 2)), (-1, 24))), 768),
    # its key/value projection: one head; only that head's shard is fetched
    ("head", lambda x: jnp.transpose(x[1]), 24 * 8),
    ("flip, added axis", lambda x: jnp.flip(x, 1)[None], 768),
    ("strided slice", lambda x: x[:, 1:23:2].reshape(4, -1), 768),
]


@pytest.fixture(scope="module")
def kernel() -> jax.Array:
    """Sharded on its heads over "model" and its hidden axis over "batch" of a (2, 4) mesh."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("batch", "model"))
    values = np.random.default_rng(0).standard_normal((4, 24, 8)).astype(jnp.bfloat16)
    return jax.device_put(values, NamedSharding(mesh, PartitionSpec("model", "batch", None)))


@pytest.mark.parametrize("name, operations, fetched", CHAINS, ids=[c[0] for c in CHAINS])
def test_fetched_and_replayed_moves_are_jaxs_result(kernel, name, operations, fetched):
    eqns = hub_tensors._flat(jax.make_jaxpr(operations)(kernel).jaxpr.eqns)  # `jit`s inlined
    moves = host_moves.moves_of(eqns)
    assert moves is not None
    host, rest = host_moves.fetch(kernel, moves, 1 << 20, lambda fn, items: [fn(i) for i in items])
    assert host.size == fetched
    result = host_moves.replay(host, rest)
    want = np.asarray(operations(kernel))
    assert result.dtype == want.dtype and result.shape == want.shape
    np.testing.assert_array_equal(result.view(np.uint16), want.view(np.uint16))


def test_a_value_changing_operation_is_no_move(kernel):
    eqns = jax.make_jaxpr(lambda x: jnp.transpose(x * 2))(kernel).jaxpr.eqns
    assert host_moves.moves_of(eqns) is None
    eqns = jax.make_jaxpr(lambda x: x.astype(jnp.float32))(kernel).jaxpr.eqns
    assert host_moves.moves_of(eqns) is None
