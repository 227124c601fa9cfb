"""What every kind of saved state offers: its arrays, their reads, and its match against a model.

A `Source` is opened by `resolve.open_source`, the one place that decides what a location names.
Every verb asks it the same questions, so a location means the same thing to every verb:

```python
source = open_source("ckpt/8")                 # step 8 of ckpt, however it is spelled
source.record.variables["dense/kernel"]         # key -> shape, dtype, Keras path, layout
prepared = source.prepare(model, strict=True)   # the reads onto the model's shardings, or problems
```
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from keras_orbax._src.format.own_state import OwnState
from keras_orbax._src.format.step_record import StepRecord

# Keras, JAX and what restores with them load where a source restores, not where it is opened:
# `keras-orbax inspect` lists a step's record without them.
if TYPE_CHECKING:
    import jax
    import keras

    from keras_orbax._src.model import state_keys
    from keras_orbax._src.model.matching import Plan, ReadRequest
    from keras_orbax._src.read.sharded_read import ReadPlan

SourceKind = Literal[
    "keras-orbax", "keras-checkpoint", "keras-weights", "keras-preset", "transformers"
]


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A restore planned against one model: nothing is read or changed yet.

    Attributes:
        record: The saved arrays, keyed by the model's keys where they pair with a variable.
        state: The model's keyed state (through a deferred stand-in of an unbuilt optimizer).
        plan: What to read onto which sharding; what is missing, unexpected or mismatched.
        reads: How this process reads each planned array; None where there are problems (no
            file is checked for a restore that cannot go ahead).
        problems: Why a restore with this strictness cannot go ahead (empty: it can).
        hint: What the source adds to a mismatch error about how it shows its side.
        unverified: Keys of arrays its reads do not check against a recorded checksum; None:
            none is checked (no `verify`, or a source that records none).
    """

    record: StepRecord
    state: state_keys.KeyedState
    plan: Plan
    reads: ReadPlan | None
    problems: tuple[str, ...]
    hint: str = ""
    unverified: tuple[str, ...] | None = None  # keys read unchecked (None: every key)


@dataclasses.dataclass(frozen=True)
class FileCheck:
    """What checking a source's array files found: all of it passed, or it raised."""

    files: int  # files read back whole
    nbytes: int
    checksummed: int  # files whose recorded checksum matched
    unchecked: tuple[str, ...]  # keys of arrays no recorded checksum covers
    why_unchecked: str = ""  # in words


class Source(abc.ABC):
    """Arrays saved somewhere, each readable region by region onto target shardings.

    Attributes:
        kind: Which kind of saved state.
        description: The kind in the words a message uses.
        location: The resolved location: absolute, `~` expanded, or a `gs://`/`s3://` URL.
        record: The arrays by this source's own keys, with the step's epoch and model config.
        step: The step of a step-based kind; None for files and directories of weights.
        steps: Every committed step of the checkpoint root (empty for other kinds).
    """

    kind: ClassVar[SourceKind]
    description: ClassVar[str]
    no_checksums: ClassVar[str] = "records no checksums"

    def __init__(
        self, location: Any, record: StepRecord, step: int | None = None, steps: Sequence[int] = ()
    ) -> None:
        self.location, self.record, self.step, self.steps = location, record, step, tuple(steps)

    @property
    def label(self) -> str:
        """The location as messages name it: the step's directory (`DIR/STEP`) for a step."""
        return str(self.location) if self.step is None else f"{self.location}/{self.step}"

    @property
    def where(self) -> Any:
        """The location a tool's report names: `location` (for a step that resume moved aside,
        that step's directory, which is no step of the root)."""
        return self.location

    def step_directory(self, step: int) -> Any:
        """The directory of step `step` of this source's checkpoint root."""
        return self.location / str(step)

    @property
    def model_config(self) -> dict[str, Any] | None:
        """The Keras model config saved with the arrays, if any."""
        return self.record.model_config

    def own_state(self) -> OwnState | None:
        """What the model's layers stored besides their variables (values that are no variable,
        asset files), as Keras's `.keras` saving keeps them; None where this source keeps none.

        Raises:
            CorruptCheckpointError: the files holding it are damaged.
        """
        return None

    def keyed_state(
        self, model: keras.Model, optimizer: keras.optimizers.Optimizer | None = None
    ) -> state_keys.KeyedState:
        """`model`'s state by the keys this source pairs with its arrays."""
        from keras_orbax._src.model import state_keys

        return state_keys.keyed_state(model, optimizer=optimizer)

    @abc.abstractmethod
    def plan_reads(self, requests: Sequence[ReadRequest]) -> ReadPlan:
        """How to read `requests` (by this source's own keys) onto their targets."""

    @abc.abstractmethod
    def prepare(self, model: keras.Model, *, strict: bool) -> Prepared:
        """Pairs the saved arrays with `model`'s variables and plans the reads; changes nothing."""

    def check_files(
        self, keys: Sequence[str] | None = None, on_file: Callable[[int], None] | None = None
    ) -> FileCheck | None:
        """Reads back the files of `keys` (by this source's keys; None: all) and checks them
        against what was recorded when they were written; None where nothing is recorded.

        Raises:
            CorruptCheckpointError: a file is missing, truncated, or fails its checksum.
        """
        return None

    def verified_reads(
        self, reads: ReadPlan, *, read_back: bool = False
    ) -> tuple[ReadPlan, FileCheck | None]:
        """`reads` made to check what they read against the checksums recorded with it (a
        restore with `verify`), and what that leaves unchecked; None where nothing is recorded.
        `read_back`: a file read only in part is read back whole to be checked (else its array
        is reported in `ReadPlan.checks.unchecked`).

        Raises:
            CorruptCheckpointError: a file checked before reading (one no read covers whole)
                fails its checksum.
        """
        return reads, None

    def read_array(self, key: str, sharding: Any = None) -> jax.Array:
        """One array by this source's own key, whole, on one device (or on `sharding`)."""
        return self.read_arrays([key], sharding)[key]

    def read_arrays(self, keys: Sequence[str], sharding: Any = None) -> dict[str, jax.Array]:
        """Arrays by this source's own keys, each whole on one device (or on `sharding`), in one
        read: an Orbax-backed source pays its per-load cost (about 20 ms) once, not per key."""
        import jax

        from keras_orbax._src.model.matching import ReadRequest
        from keras_orbax._src.read.sharded_read import read_arrays

        sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        requests = []
        for key in keys:
            saved = self.record.variables[key]
            target = jax.ShapeDtypeStruct(saved.shape, saved.dtype, sharding=sharding)
            requests.append(ReadRequest(saved, target))
        arrays, _ = read_arrays(self.plan_reads(requests))
        return {key: arrays[key] for key in keys}


READ_BATCH_BYTES = 64 << 20


def batched(keys: Sequence[str], nbytes: Callable[[str], int]) -> Iterator[list[str]]:
    """`keys` in consecutive batches of up to `READ_BATCH_BYTES` (by `nbytes`), each for one
    `Source.read_arrays`: a read has a fixed cost (an Orbax load: about 20 ms), and host memory
    holds one batch at a time."""
    batch: list[str] = []
    size = 0
    for key in keys:
        if batch and size + nbytes(key) > READ_BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += nbytes(key)
    if batch:
        yield batch
