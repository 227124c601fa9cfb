"""A `tf.data` iterator's own checkpoint (`tf.train.Checkpoint(iterator=...)`), as JSON for the
step's input position (`input_kinds`): the checkpoint's files, base64-encoded. Its size is what
TensorFlow saves for the pipeline: small for a pipeline that maps and batches, as large as the
buffer for a `shuffle` or `prefetch` buffer that holds elements.

```python
state = tf_iterator_state.save(iterator)       # JSON-safe
tf_iterator_state.restore(iter(dataset), state)  # goes on where `iterator` was
```
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path
from typing import Any

_PREFIX = "iterator"


def save(iterator: Any) -> dict[str, str]:
    """The checkpoint of a `tf.data` iterator: file name suffix -> base64 bytes."""
    import tensorflow as tf

    with tempfile.TemporaryDirectory() as folder:
        tf.train.Checkpoint(iterator=iterator).write(str(Path(folder) / _PREFIX))
        return {
            path.name[len(_PREFIX) :]: base64.b64encode(path.read_bytes()).decode("ascii")
            for path in sorted(Path(folder).iterdir())
        }


def restore(iterator: Any, state: dict[str, str]) -> None:
    """Puts a new iterator of the same `tf.data` pipeline where the saved one was.

    Raises:
        ValueError: (or TensorFlow's errors) the state is not of this pipeline.
    """
    import tensorflow as tf

    with tempfile.TemporaryDirectory() as folder:
        for suffix, data in state.items():
            if "/" in suffix or suffix.startswith(".."):
                raise ValueError(f"Not a tf.data iterator checkpoint file: {suffix!r}")
            (Path(folder) / f"{_PREFIX}{suffix}").write_bytes(base64.b64decode(data))
        tf.train.Checkpoint(iterator=iterator).read(str(Path(folder) / _PREFIX)).assert_consumed()
