"""The only place that touches private Keras, keras-hub, Orbax, etils and JAX symbols, each wrapped
with why no public API serves."""
