"""``python -m lightning_pat.cli``: the same entry point as the ``lightning-pat`` console script."""

from lightning_pat.cli.app import main

main()
