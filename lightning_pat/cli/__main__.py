"""``python -m lightning_pat.cli``: the same entry point as the ``lightning-pat`` console script."""

import sys

from lightning_pat.cli.app import main

sys.exit(main())
