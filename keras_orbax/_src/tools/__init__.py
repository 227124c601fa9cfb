"""The verbs that look at saved state without training: `inspect`, `verify`, `diff`, the restore
plan report, `convert`; and the `keras-orbax` command line's parts (`cli_*`), which
`keras_orbax.cli` wires together."""
