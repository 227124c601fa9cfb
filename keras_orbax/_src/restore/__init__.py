"""The verbs that read into a model: `restore_sharded`, `load_model`, `from_preset`."""
