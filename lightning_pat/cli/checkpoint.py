"""The checkpoint reader behind ``lightning-pat shrink``: read a run's checkpoint, rebuild its model, shrink, export.

No argument parsing here (that is :mod:`lightning_pat.cli.app`); every function is usable from Python.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningArgumentParser
from torch import nn

from lightning_pat.core.pruning_warning import PruningWarning
from lightning_pat.core.saved_state import SavedState, callback_state
from lightning_pat.shrink import restore_shrunk
from lightning_pat.shrink.plan import read_saved
from lightning_pat.training.state import SIDE_PREFIX
from lightning_pat.training.trainer_facts import checkpoint_meta


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


def load_checkpoint(ckpt_path: str | Path) -> dict[str, Any]:
    """Read a Lightning checkpoint, a ``.ckpt`` file or a distributed checkpoint directory, without running code.

    Files are read with ``torch.load(weights_only=True)`` (tensors, containers, plain values and Lightning's
    ``AttributeDict``): a checkpoint that asks for any other Python object is refused before anything is called.
    A directory written under ``ModelParallelStrategy`` (``save_distributed_checkpoint=True``) holds the sharded
    ``state_dict`` and optimizer states plus ``meta.pt`` (everything else: callbacks, hyperparameters); its shards are
    read in memory (:func:`~lightning_pat.parallel.comm.dcp.read_distributed_checkpoint`: the ``.metadata``
    file through an allow-list unpickler, shard names confined to the directory), nothing is written next to it.

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
    if not path.is_file() and not (path / "meta.pt").is_file():
        raise FileNotFoundError(
            f"{path} is a directory but not a Lightning distributed checkpoint (no `meta.pt` inside)."
        )
    checkpoint = dict(checkpoint_meta(path))
    if not path.is_file():
        from lightning_pat.parallel.comm.dcp import read_distributed_checkpoint

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
        ValueError: If the file cannot be read, is not YAML or not a mapping, has no ``model.class_path``, or the model
            cannot be built from its ``init_args``.
        FileNotFoundError: If the file does not exist.
    """
    import yaml

    path = Path(config)
    if not path.exists():
        raise FileNotFoundError(f"--config {config}: no such file")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"--config {config}: not valid YAML{where} ({problem}).") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--config {config}: cannot read it ({type(err).__name__}: {err}).") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ValueError(
            f"--config {config}: a LightningCLI config is a YAML mapping (`model: {{class_path: ..., init_args: "
            f"...}}`), but the file holds a {type(loaded).__name__}; pass the run's config.yaml."
        )
    section = (loaded or {}).get("model")
    if not isinstance(section, dict) or "class_path" not in section:
        raise ValueError(f"{config} has no `model: {{class_path: ..., init_args: ...}}` section.")
    _module_class(section["class_path"], where=f"{config}: model.class_path")  # before jsonargparse calls anything
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningModule, "model", fail_untyped=False)
    try:
        parsed = parser.parse_object({"model": section})
        model: LightningModule = parser.instantiate_classes(parsed).model
        return model
    except Exception as err:  # noqa: BLE001 - jsonargparse's errors and the model's own: one line naming the file
        cause = root_cause(err)  # jsonargparse wraps the model's own error in "Does not validate against ..."
        text = str(cause).strip().splitlines()
        raise ValueError(
            f"{config}: cannot build the model {section['class_path']!r} from its init_args "
            f"({type(cause).__name__}: {text[0] if text else cause})."
        ) from None


def root_cause(err: BaseException) -> BaseException:
    """The first error of a chain (``__cause__``, else ``__context__``): the model's own, under jsonargparse's."""
    seen = {id(err)}
    while (inner := err.__cause__ or err.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        err = inner
    return err


def _export_target(module: nn.Module, attribute: str | None) -> nn.Module:
    if attribute:
        try:
            return module.get_submodule(attribute)
        except AttributeError:
            children = [name for name, _ in module.named_children()]
            raise ValueError(
                f"--submodule {attribute!r}: {type(module).__name__} has no such submodule (its children: "
                f"{children[:8]}); pass an attribute path such as {children[0] if children else 'model'!r}."
            ) from None
    try:
        from transformers import PreTrainedModel

        pretrained = [m for m in module.children() if isinstance(m, PreTrainedModel)]
    except ImportError:  # pragma: no cover - transformers is optional
        pretrained = []
    if len(pretrained) == 1:
        return pretrained[0]
    named = list(module.named_children())
    if len(named) == 1:
        return named[0][1]
    return module


def shrink_checkpoint(
    ckpt_path: str | Path,
    output: str | Path,
    *,
    config: str | Path | None = None,
    model_class: str | None = None,
    submodule: str | None = None,
    overwrite: bool = False,
    tokenizer: object = "auto",
    format: str | Sequence[str] = "hf",  # noqa: A002 - save_pretrained's name
    gguf_dtype: str = "f32",
) -> Path:
    """Load a checkpoint's model, cut the pruned units out, and save the smaller model.

    The model is named by ``config`` or ``model_class`` if given (a LightningModule class path, instantiated with
    the hyperparameters saved in the checkpoint), else by the run's LightningCLI ``config.yaml`` found next to the
    checkpoint, else by the class path LightningCLI records in the checkpoint's hyperparameters. The weights load
    from the checkpoint, the shrink reads the :class:`~lightning_pat.CoupledPruningCallback` state in it, and the
    exported model is the LightningModule's only transformers model (``save_pretrained``), else its only child
    module, else ``submodule`` or the whole module (a ``torch.save``'d module plus its sizes).

    The tokenizer goes next to the model: with ``tokenizer="auto"``, the LightningModule's ``tokenizer`` attribute if
    it has one with ``save_pretrained`` (``lightning_pat.lm.CausalLM`` keeps its tokenizer there), else the tokenizer
    files of the directory the model's config names (``name_or_path``), else none.

    Args:
        ckpt_path: A ``.ckpt`` file, or a distributed checkpoint directory written under ``ModelParallelStrategy``.
        output: Directory to write.
        config: The run's config (default: the ``config.yaml`` next to the checkpoint's logs).
        model_class: LightningModule class path, used when there is no config.
        submodule: Attribute path of the module to export (default: see above).
        overwrite: Replace an earlier export in ``output`` (a non-empty ``output`` is refused otherwise).
        tokenizer: ``"auto"`` (see above), ``None``, a tokenizer object or a directory holding tokenizer files.
        format: As for :func:`~lightning_pat.export.pretrained.save_pretrained`: ``"hf"``, ``"decilm"``, ``"gguf"`` or
            a list (``["decilm", "gguf"]``).
        gguf_dtype: The GGUF tensor type (``"f32"``, ``"f16"``, ``"bf16"``, ``"q8_0"``, ...).

    Returns:
        The output directory.

    Raises:
        ValueError: If the checkpoint cannot be read safely, the model cannot be named (or its class path names
            anything but a LightningModule / ``nn.Module`` class), the checkpoint holds no pruning state, or
            ``format`` / ``gguf_dtype`` / ``tokenizer`` is refused (as by ``save_pretrained``), or ``output`` is,
            or holds, the checkpoint or the run's config (checked before the load, whatever ``overwrite`` says).
        FileExistsError: If ``output`` is not empty and ``overwrite`` is false, or was not written by lightning_pat
            (checked before the load; the directory the model was loaded from is refused before anything is
            written, as by ``save_pretrained``).
    """
    from lightning_pat import shrink
    from lightning_pat.export.pretrained import check_directory, check_format, save_pretrained

    # an export never replaces what it is made from: the checkpoint (a file or a distributed checkpoint directory)
    # and the run's config are refused as the output, or as a directory above it, whatever `overwrite` says
    sources = [
        ("the checkpoint", ckpt_path),
        ("the run's config", config if config is not None else find_config(ckpt_path)),
    ]
    check_directory(
        output, overwrite=overwrite, option="overwrite=True (lightning-pat shrink: --overwrite)", sources=sources
    )
    check_format(format, gguf_dtype=gguf_dtype)
    checkpoint = load_checkpoint(ckpt_path)
    # the one lookup (exactly one CoupledPruningCallback state, else a ValueError naming them) and the one schema
    # check, before the model is built; the restore, the warning and the shrink below take this state as read
    saved = read_saved(callback_state(checkpoint), "the checkpoint's pruning state")
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    if config is None and model_class is None:
        config = find_config(ckpt_path)
        model_class = hparams.get("_class_path") if config is None else None  # LightningCLI stores it
    if config is not None:
        module: nn.Module = model_from_config(config)
    elif model_class is not None:
        cls = _module_class(model_class, where=f"the model class of {ckpt_path}")
        init_args = {k: v for k, v in hparams.items() if not k.startswith("_")}
        try:
            module = cls(**init_args)
        except Exception as err:  # noqa: BLE001 - the user's constructor: one line naming the class and arguments
            raise ValueError(
                f"cannot build {model_class} from the checkpoint's hyperparameters {sorted(init_args)[:8]} "
                f"({type(err).__name__}: {err}); pass `--config` (the run's LightningCLI config)."
            ) from None
    else:
        raise ValueError(
            f"No config.yaml found next to {ckpt_path} and no class path in its hyperparameters; pass `--config` "
            "(the run's LightningCLI config) or `--model_class` (a LightningModule that saved its hyperparameters)."
        )
    target = _export_target(module, submodule)
    # a run with `shrink_on_freeze=True` saved the small weights: give the fresh module their shapes first
    already_small = restore_shrunk(target, saved)
    # distributed checkpoints carry the sharded latent copies and teacher next to the weights: not model state
    weights = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(SIDE_PREFIX)}
    try:
        module.load_state_dict(weights)
    except RuntimeError as err:  # missing/unexpected keys, other shapes: the model is not the checkpoint's
        detail = " ".join(line.strip() for line in str(err).splitlines() if line.strip())[:400]
        raise ValueError(
            f"shrink: the checkpoint's weights do not fit {type(module).__name__} as built ({detail}); "
            "pass the run's config (`--config`) or the class and hyperparameters the checkpoint was written with."
        ) from None
    if not already_small:
        _warn_if_not_final(saved)
        shrink(target, saved)  # the clusters name parameters of `module`; shrink strips the common prefix
    if isinstance(tokenizer, str) and tokenizer == "auto":
        tokenizer = module_tokenizer(module) or "auto"
    return save_pretrained(
        target.eval(), output, overwrite=overwrite, tokenizer=tokenizer, format=format, gguf_dtype=gguf_dtype
    )


def module_tokenizer(module: nn.Module) -> Any:
    """The LightningModule's ``tokenizer`` attribute if it can write itself (``save_pretrained``), else ``None``."""
    found = getattr(module, "tokenizer", None)
    return found if callable(getattr(found, "save_pretrained", None)) else None


def _warn_if_not_final(saved: SavedState) -> None:
    """Warn when the checkpoint was written before the schedule's final step (the mask may still change)."""
    if saved.options and not saved.is_final:
        warnings.warn(
            f"lightning-pat shrink: the checkpoint was written at pruning step {saved.step}, before the final ramp "
            f"step {saved.final_step}; the shrunk model removes the units dropped so far (the mask was not final). "
            "Shrink a checkpoint from the end of the ramp or later for the final widths.",
            PruningWarning,
            stacklevel=3,
        )
