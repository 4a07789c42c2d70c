"""The ``lightning-pat`` command: LightningCLI with pruning, plus ``lightning-pat shrink`` for checkpoints.

::

    lightning-pat fit --config examples/configs/demo.yaml        # train (and prune) from a YAML file
    lightning-pat validate --config ... --ckpt_path CKPT          # evaluate a checkpoint
    lightning-pat shrink --ckpt_path CKPT --output DIR            # cut the pruned units out of a checkpoint's model
    python -m lightning_pat.cli ...                               # the same without the console script

Any LightningModule / LightningDataModule can be named by ``class_path`` in the config, and
``lightning_pat.CoupledPruningCallback`` goes under ``trainer.callbacks`` with its ``init_args``: a preset name
(``clusters: tiny_gpt``) or a list of cluster declarations (``clusters: [{name: ..., writers: [...], ...}]``).
``fit --help`` lists the callback's options; ``fit --trainer.callbacks.help CoupledPruningCallback`` prints them
with their types and defaults.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import textwrap
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch import nn
from typing_extensions import override

from lightning_pat.callback import CoupledPruningCallback
from lightning_pat.shrink import checkpoint_state, restore_shrunk
from lightning_pat.state import DCP_PREFIX

_CALLBACK_PATH = "lightning_pat.CoupledPruningCallback"


class StepProgressBar(TQDMProgressBar):
    """A TQDM progress bar counted in optimizer steps up to ``max_steps``, without an epoch counter.

    Step-based runs (``max_steps`` with ``max_epochs=-1``) otherwise show ``Epoch 4/-2``; this bar reads
    ``train: 120/300 [.., train_loss=1.9, pruning/unit_sparsity=0.25]``. Runs without ``max_steps`` keep the
    standard per-epoch bar.
    """

    def _by_steps(self, trainer: Trainer) -> bool:
        return trainer.max_steps is not None and trainer.max_steps > 0

    @override
    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        """Set the bar's total to ``max_steps`` once (it is not reset per epoch)."""
        if not self._by_steps(trainer):
            super().on_train_epoch_start(trainer, *args)
            return
        bar = self.train_progress_bar
        if bar.total != trainer.max_steps:
            bar.reset(total=trainer.max_steps)
            bar.initial = 0
        bar.set_description("train")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """Advance to the number of optimizer steps taken and refresh the metrics."""
        if not self._by_steps(trainer):
            super().on_train_batch_end(trainer, pl_module, *args)
            return
        bar = self.train_progress_bar
        if bar is not None and self._should_update(trainer.global_step, bar.total):
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, int | str | float | dict]:
        """The progress-bar metrics without the logger's version number."""
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


def callback_options_help() -> str:
    """The ``Args:`` section of :class:`~lightning_pat.CoupledPruningCallback`'s docstring, as help text.

    Returns:
        One line per option (``  name  description``), for the epilog of ``lightning-pat fit --help``.
    """
    doc = inspect.getdoc(CoupledPruningCallback) or ""
    section = doc.split("Args:\n", 1)[1].split("\n\n", 1)[0] if "Args:\n" in doc else ""
    options: list[tuple[str, str]] = []
    for line in section.splitlines():
        match = re.match(r"^    (\w+): (.*)$", line)
        if match:
            options.append((match.group(1), match.group(2)))
        elif options and line.strip():
            options[-1] = (options[-1][0], f"{options[-1][1]} {line.strip()}")
    width = max((len(name) for name, _ in options), default=0)
    lines = [
        f"Pruning: add the callback under trainer.callbacks (class_path: {_CALLBACK_PATH}) with these init_args",
        "(`--trainer.callbacks.help CoupledPruningCallback` prints their types and defaults):",
    ]
    for name, text in options:
        text = re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"\1", text).replace("``", "")  # reST markup -> plain
        wrapped = textwrap.wrap(text, width=max(100 - width - 4, 40))
        lines += [f"  {name if i == 0 else '':<{width}}  {line}" for i, line in enumerate(wrapped)]
    return "\n".join(lines)


class _HelpFormatter(DefaultHelpFormatter):
    """Keep the epilog's line breaks (the option table)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


class PatCLI(LightningCLI):
    """LightningCLI whose Trainer shows a step-counted progress bar (see :class:`StepProgressBar`)."""

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Add a :class:`StepProgressBar` unless the config disables the bar or brings its own."""
        config = self._get(self.config_init, "trainer", default={})
        callbacks = config.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        wants_bar = config.get("enable_progress_bar", True) is not False
        if wants_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
            config["callbacks"] = [*callbacks, StepProgressBar()]
        return super().instantiate_trainer(**kwargs)


def cli_main(args: list[str] | None = None, *, run: bool = True) -> PatCLI:
    """Run the Lightning CLI (``fit``, ``validate``, ``test``, ``predict``) with subclass mode for model and data.

    Args:
        args: Command-line arguments (defaults to ``sys.argv[1:]``).
        run: Whether to run the subcommand (``False``: parse and instantiate only).

    Returns:
        The CLI object (its ``trainer`` and ``model`` are available after the subcommand ran).
    """
    epilog = callback_options_help()
    sub = {"epilog": epilog}
    return PatCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={
            "description": "Pruning-aware training with LightningCLI. Also: `lightning-pat shrink --help`.",
            "formatter_class": _HelpFormatter,  # subcommand parsers inherit it
            "fit": dict(sub),
            "validate": dict(sub),
        },
        args=args,
        run=run,
    )


# ---------------------------------------------------------------------- shrink


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    if not module:
        raise ValueError(f"Expected a dotted class path such as `my_package.MyModule`, got {class_path!r}.")
    return getattr(importlib.import_module(module), name)


def load_checkpoint(ckpt_path: str | Path) -> dict[str, Any]:
    """Read a Lightning checkpoint: a ``.ckpt`` file, or a distributed checkpoint directory.

    A directory written under ``ModelParallelStrategy`` (``save_distributed_checkpoint=True``) holds the sharded
    ``state_dict`` and optimizer states plus ``meta.pt`` (everything else: callbacks, hyperparameters). It is
    converted with torch's ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` into one file next to
    it (``<dir>.consolidated.pt``, kept for reuse), then read like a ``.ckpt`` file.

    Args:
        ckpt_path: The checkpoint file or directory.

    Returns:
        The checkpoint dict (``state_dict``, ``callbacks``, ``hyper_parameters``, ...).

    Raises:
        FileNotFoundError: If the path does not exist or a directory lacks ``meta.pt``.
    """
    path = Path(ckpt_path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint not found: {path}")
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=False)
    meta = path / "meta.pt"
    if not meta.is_file():
        raise FileNotFoundError(
            f"{path} is a directory but not a Lightning distributed checkpoint (no `meta.pt` inside)."
        )
    from lightning_pat.distributed import consolidate_checkpoint

    consolidated = consolidate_checkpoint(path, path.with_name(path.name + ".consolidated.pt"))
    checkpoint = torch.load(meta, map_location="cpu", weights_only=False)
    checkpoint["state_dict"] = torch.load(consolidated, map_location="cpu", weights_only=False)["state_dict"]
    return checkpoint


def find_config(ckpt_path: str | Path) -> Path | None:
    """The ``config.yaml`` LightningCLI saved for the run that wrote a checkpoint, if any.

    LightningCLI writes it into the log directory; checkpoints go to ``<log dir>/checkpoints/``. The checkpoint's
    directory and the two above it are searched.

    Args:
        ckpt_path: The checkpoint file or directory.

    Returns:
        The path of ``config.yaml``, or ``None``.
    """
    parent = Path(ckpt_path).resolve().parent
    for folder in (parent, parent.parent, parent.parent.parent):
        if (folder / "config.yaml").is_file():
            return folder / "config.yaml"
    return None


def model_from_config(config: str | Path) -> LightningModule:
    """Instantiate the ``model`` section of a LightningCLI config (``class_path`` and ``init_args``).

    Args:
        config: A YAML file such as the ``config.yaml`` LightningCLI saves next to a run's logs.

    Returns:
        The LightningModule, freshly initialised (``configure_model`` is not called).

    Raises:
        ValueError: If the file has no ``model.class_path``.
    """
    import yaml

    section = (yaml.safe_load(Path(config).read_text()) or {}).get("model")
    if not isinstance(section, dict) or "class_path" not in section:
        raise ValueError(f"{config} has no `model: {{class_path: ..., init_args: ...}}` section.")
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningModule, "model", fail_untyped=False)
    parsed = parser.parse_object({"model": section})
    return parser.instantiate_classes(parsed).model


def _export_target(module: LightningModule, attribute: str | None) -> nn.Module:
    if attribute:
        target = module.get_submodule(attribute)
        if target is None:
            raise ValueError(f"The model has no submodule {attribute!r}.")
        return target
    try:
        from transformers import PreTrainedModel

        pretrained = [m for m in module.children() if isinstance(m, PreTrainedModel)]
    except ImportError:  # pragma: no cover - transformers is optional
        pretrained = []
    if len(pretrained) == 1:
        return pretrained[0]
    children = list(module.named_children())
    if len(children) == 1:
        return children[0][1]
    return module


def shrink_checkpoint(
    ckpt_path: str | Path,
    output: str | Path,
    *,
    config: str | Path | None = None,
    model_class: str | None = None,
    submodule: str | None = None,
) -> Path:
    """Load a checkpoint's model, cut the pruned units out, and save the smaller model.

    The model is named by ``config`` or ``model_class`` if given (a LightningModule class path, instantiated with
    the hyperparameters saved in the checkpoint), else by the run's LightningCLI ``config.yaml`` found next to the
    checkpoint, else by the class path LightningCLI records in the checkpoint's hyperparameters. The weights load
    from the checkpoint, the shrink reads the :class:`~lightning_pat.CoupledPruningCallback` state in it, and the
    exported model is the LightningModule's only transformers model (``save_pretrained``), else its only child
    module, else ``submodule`` or the whole module (a ``torch.save``'d module plus its sizes).

    Args:
        ckpt_path: A ``.ckpt`` file, or a distributed checkpoint directory written under ``ModelParallelStrategy``.
        output: Directory to write.
        config: The run's config (default: the ``config.yaml`` next to the checkpoint's logs).
        model_class: LightningModule class path, used when there is no config.
        submodule: Attribute path of the module to export (default: see above).

    Returns:
        The output directory.

    Raises:
        ValueError: If the model cannot be named or the checkpoint holds no pruning state.
    """
    from lightning_pat import shrink
    from lightning_pat.export import save_pretrained

    checkpoint = load_checkpoint(ckpt_path)
    state = checkpoint_state(checkpoint)  # exactly one CoupledPruningCallback state, else a ValueError naming them
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    if config is None and model_class is None:
        config = find_config(ckpt_path)
        model_class = hparams.get("_class_path") if config is None else None  # LightningCLI stores it
    if config is not None:
        module = model_from_config(config)
    elif model_class is not None:
        init_args = {k: v for k, v in hparams.items() if not k.startswith("_")}
        module = _import(model_class)(**init_args)
    else:
        raise ValueError(
            f"No config.yaml found next to {ckpt_path} and no class path in its hyperparameters; pass `--config` "
            "(the run's LightningCLI config) or `--model_class` (a LightningModule that saved its hyperparameters)."
        )
    target = _export_target(module, submodule)
    # a run with `shrink_on_freeze=True` saved the small weights: give the fresh module their shapes first
    already_small = restore_shrunk(target, checkpoint)
    # mid-ramp distributed checkpoints carry the sharded latent copies next to the weights: not model state
    weights = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(DCP_PREFIX)}
    module.load_state_dict(weights)
    if not already_small:
        _warn_if_not_final(state)
        shrink(target, checkpoint)  # the clusters name parameters of `module`; shrink strips the common prefix
    return save_pretrained(target.eval(), output)


def _warn_if_not_final(state: Mapping[str, Any]) -> None:
    """Warn when the checkpoint was written before the schedule's final step (the mask may still change)."""
    options = state.get("options") or {}
    final = int(options.get("warmup_steps", 0)) + int(options.get("ramp_steps", 0))
    if options and int(state.get("step", 0)) < final:
        warnings.warn(
            f"lightning-pat shrink: the checkpoint was written at pruning step {state.get('step')}, before the final "
            f"ramp step {final}; the shrunk model removes the units dropped so far (the mask was not final). Shrink "
            "a checkpoint from the end of the ramp or later for the final widths.",
            UserWarning,
            stacklevel=3,
        )


def shrink_main(args: list[str] | None = None) -> Path:
    """``lightning-pat shrink``: parse the arguments and run :func:`shrink_checkpoint`.

    Args:
        args: Arguments after ``shrink``.

    Returns:
        The output directory.
    """
    parser = argparse.ArgumentParser(
        prog="lightning-pat shrink",
        description=(
            "Cut the units a CoupledPruningCallback dropped out of a checkpoint's model and save the smaller model "
            "(save_pretrained for transformers models, else a torch.save'd module plus its sizes)."
        ),
    )
    parser.add_argument(
        "--ckpt_path", required=True, help="a .ckpt file, or a ModelParallelStrategy distributed checkpoint directory"
    )
    parser.add_argument("--output", required=True, help="directory to write the shrunk model to")
    parser.add_argument("--config", help="the run's LightningCLI config (default: config.yaml next to the logs)")
    parser.add_argument("--model_class", help="LightningModule class path, instead of a config (uses saved hparams)")
    parser.add_argument("--submodule", help="attribute path of the module to export (default: the wrapped model)")
    ns = parser.parse_args(args)
    out = shrink_checkpoint(
        ns.ckpt_path, ns.output, config=ns.config, model_class=ns.model_class, submodule=ns.submodule
    )
    sys.stdout.write(f"shrunk model written to {out}\n")
    return out


def main(args: list[str] | None = None) -> PatCLI | Path:
    """Entry point of ``lightning-pat``: ``shrink`` is handled here, every other subcommand by LightningCLI.

    Args:
        args: Command-line arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The CLI object, or the output directory of ``shrink``.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] == "shrink":
        return shrink_main(argv[1:])
    return cli_main(args)


if __name__ == "__main__":  # pragma: no cover - exercised through subprocess in tests
    main()
