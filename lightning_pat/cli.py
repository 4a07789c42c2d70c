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
import difflib
import importlib
import inspect
import re
import sys
import textwrap
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch import nn
from typing_extensions import override

from lightning_pat._state import DCP_PREFIX
from lightning_pat.callback import CoupledPruningCallback
from lightning_pat.safe_io import confined, load_torch_file
from lightning_pat.shrink import checkpoint_state, restore_shrunk

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


_NOT_ACCEPTED = re.compile(r"class_path '([\w.]+)':\s*\n\s*Option '(\w+)' is not accepted")
_KEY = re.compile(r'Parser key "([\w.]+)"')


def _init_parameters(class_path: str) -> list[str]:
    """The keyword arguments a class path's ``__init__`` takes (empty if it cannot be imported)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        params = inspect.signature(cls.__init__).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [name for name, p in params.items() if name != "self" and p.kind not in variadic]


def summarize_error(message: str) -> str | None:
    """The one line that matters in a jsonargparse error, or ``None`` if there is no better line than the first.

    An unknown option in a class's ``init_args`` (a callback under ``trainer.callbacks``, the model) is reported by
    jsonargparse inside a list of every type the value failed to match; this names the option, the class and the
    closest valid option.

    Args:
        message: The error message jsonargparse produced.

    Returns:
        For example ``trainer.callbacks: `target_sparsty` is not an option of lightning_pat.CoupledPruningCallback;
        did you mean `target_sparsity`?``.
    """
    match = _NOT_ACCEPTED.search(message)
    if match is None:
        return None
    class_path, option = match.groups()
    key = _KEY.search(message)
    where = f"{key.group(1)}: " if key else ""
    close = difflib.get_close_matches(option, _init_parameters(class_path), n=1)
    hint = f"did you mean `{close[0]}`?" if close else "see `--help` for the options."
    return f"{where}`{option}` is not an option of {class_path}; {hint}"


class PatArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors start with the line that matters (an unknown option and its fix)."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """Print a summary line before jsonargparse's detailed message, without the 60-line usage."""
        summary = summarize_error(message)
        if summary is None or not self.exit_on_error:
            super().error(message, ex)
        prog = self.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {summary}\n(for every option: {prog} --help)\n\ndetails: {message}\n")
        self.exit(2)


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
        parser_class=PatArgumentParser,
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


def _module_class(class_path: object, *, where: str) -> type[nn.Module]:
    """The ``nn.Module`` (LightningModule) subclass a class path names, checked before anything is called.

    Raises:
        ValueError: If the path is not a dotted name, cannot be imported, or names anything but an ``nn.Module``
            subclass (a function such as ``os.system``, another class).
    """
    if not isinstance(class_path, str) or "." not in class_path.strip("."):
        raise ValueError(f"{where}: expected a dotted class path such as `my_package.MyModule`, got {class_path!r}.")
    module, _, name = class_path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{where}: cannot import {class_path!r} ({err}).") from None
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise ValueError(
            f"{where}: {class_path!r} is not a LightningModule (or nn.Module) class but a {type(obj).__name__}; "
            "refused (only a model class is instantiated). Pass `--config` (the run's LightningCLI config) or "
            "`--model_class`."
        )
    return obj


def _checkpoint_globals() -> list[Any]:
    """The classes besides tensors, containers and plain values that Lightning writes into checkpoints."""
    from lightning.fabric.utilities.data import AttributeDict

    return [AttributeDict]


def load_checkpoint(ckpt_path: str | Path) -> dict[str, Any]:
    """Read a Lightning checkpoint, a ``.ckpt`` file or a distributed checkpoint directory, without running code.

    Files are read with ``torch.load(weights_only=True)`` (tensors, containers, plain values and Lightning's
    ``AttributeDict``): a checkpoint that asks for any other Python object is refused before anything is called.
    A directory written under ``ModelParallelStrategy`` (``save_distributed_checkpoint=True``) holds the sharded
    ``state_dict`` and optimizer states plus ``meta.pt`` (everything else: callbacks, hyperparameters); its shards are
    read in memory (:func:`~lightning_pat.distributed.read_distributed_checkpoint`: the ``.metadata`` file through an
    allow-list unpickler, shard names confined to the directory), nothing is written next to it.

    Args:
        ckpt_path: The checkpoint file or directory.

    Returns:
        The checkpoint dict (``state_dict``, ``callbacks``, ``hyper_parameters``, ...).

    Raises:
        FileNotFoundError: If the path does not exist or a directory lacks ``meta.pt``.
        ValueError: If a file is not a torch checkpoint, is truncated, or holds objects outside the allow-list.
    """
    path = Path(ckpt_path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint not found: {path}")
    allowed = _checkpoint_globals()
    if path.is_file():
        checkpoint = load_torch_file(path, what="checkpoint", allowed=allowed)
    else:
        meta = path / "meta.pt"
        if not meta.is_file():
            raise FileNotFoundError(
                f"{path} is a directory but not a Lightning distributed checkpoint (no `meta.pt` inside)."
            )
        from lightning_pat.distributed import read_distributed_checkpoint

        checkpoint = load_torch_file(confined(path, "meta.pt", what="checkpoint"), what="checkpoint", allowed=allowed)
        if isinstance(checkpoint, dict):
            checkpoint["state_dict"] = read_distributed_checkpoint(path).get("state_dict")
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), Mapping):
        raise ValueError(f"cannot read checkpoint {path}: not a Lightning checkpoint (no `state_dict` mapping)")
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
    _module_class(section["class_path"], where=f"{config}: model.class_path")  # before jsonargparse calls anything
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
    overwrite: bool = False,
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
        overwrite: Replace an earlier export in ``output`` (a non-empty ``output`` is refused otherwise).

    Returns:
        The output directory.

    Raises:
        ValueError: If the checkpoint cannot be read safely, the model cannot be named (or its class path names
            anything but a LightningModule / ``nn.Module`` class), or the checkpoint holds no pruning state.
        FileExistsError: If ``output`` is not empty and ``overwrite`` is false.
    """
    from lightning_pat import shrink
    from lightning_pat.export import check_directory, save_pretrained

    check_directory(output, overwrite=overwrite)  # before the (long) load
    checkpoint = load_checkpoint(ckpt_path)
    state = checkpoint_state(checkpoint)  # exactly one CoupledPruningCallback state, else a ValueError naming them
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    if config is None and model_class is None:
        config = find_config(ckpt_path)
        model_class = hparams.get("_class_path") if config is None else None  # LightningCLI stores it
    if config is not None:
        module = model_from_config(config)
    elif model_class is not None:
        cls = _module_class(model_class, where=f"the model class of {ckpt_path}")
        init_args = {k: v for k, v in hparams.items() if not k.startswith("_")}
        module = cls(**init_args)
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
    return save_pretrained(target.eval(), output, overwrite=overwrite)


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

    Raises:
        ValueError: As for :func:`shrink_checkpoint` (:func:`main` prints it as one line and exits with 1).
        FileNotFoundError: If the checkpoint does not exist.
        FileExistsError: If ``--output`` is not empty and ``--overwrite`` is not given.
    """
    parser = argparse.ArgumentParser(
        prog="lightning-pat shrink",
        description=(
            "Cut the units a CoupledPruningCallback dropped out of a checkpoint's model and save the smaller model "
            "(save_pretrained for transformers models, else safetensors plus a JSON description). The checkpoint is "
            "read without running code from it."
        ),
    )
    parser.add_argument(
        "--ckpt_path", required=True, help="a .ckpt file, or a ModelParallelStrategy distributed checkpoint directory"
    )
    parser.add_argument("--output", required=True, help="directory to write the shrunk model to (empty or new)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in --output")
    parser.add_argument("--config", help="the run's LightningCLI config (default: config.yaml next to the logs)")
    parser.add_argument("--model_class", help="LightningModule class path, instead of a config (uses saved hparams)")
    parser.add_argument("--submodule", help="attribute path of the module to export (default: the wrapped model)")
    ns = parser.parse_args(args)
    out = shrink_checkpoint(
        ns.ckpt_path,
        ns.output,
        config=ns.config,
        model_class=ns.model_class,
        submodule=ns.submodule,
        overwrite=ns.overwrite,
    )
    sys.stdout.write(f"shrunk model written to {out}\n")
    return out


def main(args: list[str] | None = None) -> int:
    """Entry point of ``lightning-pat``: ``shrink`` is handled here, every other subcommand by LightningCLI.

    The console script runs ``sys.exit(main())``: 0 on success, so ``lightning-pat fit ... && lightning-pat shrink
    ...`` works. A ``shrink`` that cannot read its input or write its output prints one line naming the problem and
    exits with 1 (no traceback); argument errors exit with 2.

    Args:
        args: Command-line arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] == "shrink":
        try:
            shrink_main(argv[1:])
        except (ValueError, FileNotFoundError, FileExistsError) as err:
            sys.stderr.write(f"lightning-pat shrink: error: {err}\n")
            return 1
        return 0
    cli_main(args)
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through subprocess in tests
    sys.exit(main())
