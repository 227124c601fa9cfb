"""The Keras side: checkpoint keys of a model's state, target shardings, deferred builds, and the
matching of a saved record against a model."""
