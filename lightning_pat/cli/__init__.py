"""The ``lightning-pat`` command: LightningCLI glue (``app``) and the checkpoint reader behind ``shrink``."""

from lightning_pat.cli.app import StepProgressBar, main
from lightning_pat.cli.checkpoint import find_config, load_checkpoint, model_from_config, shrink_checkpoint

__all__ = ["StepProgressBar", "find_config", "load_checkpoint", "main", "model_from_config", "shrink_checkpoint"]
