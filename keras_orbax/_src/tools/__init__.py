"""The verbs that look at saved state without training: `inspect`, `verify`, `diff`, the restore
plan report, `convert`."""
