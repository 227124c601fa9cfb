"""keras-orbax's on-disk step (docs/format.md): the record, step directories, the zarr shard
layout of the fast format, checksums, dtype names."""
