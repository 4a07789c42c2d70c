"""LightningCLI entry point: ``python -m lightning_pat.cli fit --config config.yaml``.

Any LightningModule / LightningDataModule can be named by ``class_path`` in the config, and
``lightning_pat.CoupledPruningCallback`` goes under ``trainer.callbacks`` with its ``init_args``: a preset name
(``clusters: tiny_gpt``) or a list of cluster declarations (``clusters: [{name: ..., writers: [...], ...}]``).
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the Lightning CLI with subclass mode for the model and the data module.

    Args:
        args: Command-line arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The CLI object (its ``trainer`` and ``model`` are available after the subcommand ran).
    """
    return LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":  # pragma: no cover - exercised through subprocess in tests
    main()
