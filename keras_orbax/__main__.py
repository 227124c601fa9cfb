"""`python -m keras_orbax ...`: the `keras-orbax` command line (see `keras_orbax.cli`)."""

import sys

from keras_orbax.cli import main

if __name__ == "__main__":
    sys.exit(main())
