"""``python -m lightning_pat.cli``: the same entry point as the ``lightning-pat`` console script."""

import sys

from lightning_pat.cli.app import main

if __name__ == "__main__":  # importing this module (e.g. a class path read from a file) runs nothing
    sys.exit(main())
