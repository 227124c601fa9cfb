"""Object storage reached through the ecosystem's environment only, with TensorFlow importable.

keras-hub pulls TensorFlow in, and with TensorFlow importable `etils.epath` sends `gs://` and `s3://`
to `tf.io.gfile` (no `s3`, no emulator). A package named `tensorflow` on `PYTHONPATH` that fails to
import stands in for it here: epath decides by `importlib.util.find_spec("tensorflow")`, so it takes
the TensorFlow route exactly as with the real one (the test checks that it does), and any use of
that route fails loudly instead of silently going elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import os, sys
    url = sys.argv[1]
    from etils import epath
    try:  # a user's own epath call before keras-orbax is imported
        epath.Path(url + "/probe").exists()
        print("epath before keras_orbax: fsspec")
    except ImportError:
        print("epath before keras_orbax: tensorflow")
    import keras
    import numpy as np
    import keras_orbax
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    keras_orbax.save(model, url + "/ckpt", step=1)
    again = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    result = keras_orbax.restore_sharded(again, url + "/ckpt")
    same = all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(model.weights, again.weights))
    print("restored", result.step, same)
    """
)


def test_object_storage_works_with_tensorflow_importable(s3_store, tmp_path):
    fake = tmp_path / "site" / "tensorflow"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ImportError('stands in for an installed TensorFlow: nothing may use it')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("EPATH_USE_TF", "XLA_FLAGS")}
    env |= s3_store.env | {"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"}
    env["KERAS_BACKEND"] = "jax"
    url = s3_store.new_bucket()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, url],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "epath before keras_orbax: tensorflow" in done.stdout  # the stand-in is taken for TF
    assert "restored 1 True" in done.stdout, done.stdout
    assert sorted(s3_store.keys(url + "/ckpt/1"))  # the step is in the bucket, not a local folder
    assert not (tmp_path / "s3:").exists()
