"""keras-orbax's implementation, one subpackage per concept (docs/architecture.md).

Imports run one way, from the verbs down to the dependencies' private symbols:

    tools, training -> restore -> sources, write -> read -> model -> format -> storage -> runtime
    -> compat

`tests/test_architecture.py` fails if a module imports against that direction. Nothing here is
public: `keras_orbax` re-exports what users call.
"""
