r"""Save and load shrunk models, without pickle.

:func:`save_pretrained` writes

* a Hugging Face model with ``model.save_pretrained(directory)``: ``config.json`` carries the new sizes. When a stock
  model built from that config has exactly the shrunk model's parameter shapes and module attributes (uniform widths;
  ``head_dim`` is written explicitly), nothing else is added and ``AutoModelForCausalLM.from_pretrained(directory)``
  loads it with no lightning_pat code. Otherwise (GPT-2 with dropped heads, per-layer widths, a residual shrink whose
  rescaled RMSNorm eps differs from Qwen3's q/k norms) ``config.json`` gets a ``"lightning_pat"`` entry (see
  :mod:`lightning_pat.shrink.hf_entry`; the shrink already puts it on ``model.config``, so the model's own
  ``small.save_pretrained(dir)`` writes it too); stock ``from_pretrained`` then refuses the size mismatch, and
  :func:`load_pretrained` loads it.
* any other module as ``model.safetensors`` (its tensors, ties stored once) plus ``lightning_pat.json``: its
  parameter shapes and a description of every submodule (class path, plain attributes, parameters, buffers, children;
  :mod:`~lightning_pat.export.module_tree`) from which :func:`load_pretrained` rebuilds it without running any
  constructor or unpickling anything. Classes are allow-listed: ``torch.nn``, ``lightning_pat``, ``transformers``
  and ``lightning`` classes, and the classes the caller passes (``load_pretrained(dir, classes=[MyNet])``).

Nothing is ever pickled or unpickled: a module the safe format cannot describe (an attribute holding a function or
an object of another class) is refused, and an export pickled by lightning_pat before 0.2 (``"format":
"torch.save"`` in ``lightning_pat.json``, a ``model.pt``) is refused with the way to convert it in your own code.

The export is built in a temporary sibling directory and moved into place at the end: a failed save leaves the
previous export as it was. A non-empty directory is refused unless ``overwrite=True``, which replaces only an earlier
export of lightning_pat (it carries ``lightning_pat_export.json``, or ``lightning_pat.json`` for a module export) and
refuses a directory holding other files. The directory a model or its tokenizer was read from (or one holding it)
is never written, whatever ``overwrite`` says, and a tokenizer with more token ids than the model's embedding rows
is refused. Every file name read from an export is confined to its directory. ``transformers`` is imported only
when a Hugging Face export is read or written.

Example::

    small = lightning_pat.shrink(model, trainer_callback)
    lightning_pat.save_pretrained(small, "out/small")
    again = lightning_pat.load_pretrained("out/small")
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch
from torch import nn

from lightning_pat.core.safe_io import atomic_directory, check_output, confined, interrupted_overwrite
from lightning_pat.export import decilm, tokenizer_files
from lightning_pat.export.checks import (
    check_description,
    check_entry,
    check_shapes,
    entry_attributes,
    read_json,
)
from lightning_pat.export.hf_loader import load_hf_class
from lightning_pat.export.llama_layout import read_layout
from lightning_pat.export.module_tree import SOURCE_ATTR, UnsupportedStateError, describe, rebuild
from lightning_pat.shrink import hf_entry
from lightning_pat.shrink.hf_entry import BASE_CONFIG_ATTR, ENTRY, LOADER

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

MODULE_FILE = "model.pt"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SIZES_FILE = "lightning_pat.json"
#: Written into every Hugging Face / DeciLM export: what marks a directory as lightning_pat's (``overwrite`` may
#: replace it). A module export is marked by its ``lightning_pat.json``.
EXPORT_MARKER = "lightning_pat_export.json"
_OWNER_MARKS = (EXPORT_MARKER, SIZES_FILE)
_VERSION = hf_entry.VERSION
_MODULE_VERSION = 2  # 1: a pickled model.pt (refused: never unpickled); 2: safetensors + module description
_EXPORT_FILES = re.compile(
    r"config\.json|generation_config\.json|lightning_pat\.json|model\.pt|model\.safetensors(\.index\.json)?|"
    r"model-\d+-of-\d+\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin(\.index\.json)?|model\.gguf|"
    r"configuration_decilm\.py|lightning_pat_export\.json"
)
#: The values of ``format``: the directory's main format ("hf" or "decilm"), and "gguf" next to it.
FORMATS = ("hf", "decilm", "gguf")


def is_export_file(name: str) -> bool:
    """Whether ``name`` is a file an export writes (what ``overwrite=True`` may replace), tokenizer files included."""
    return _EXPORT_FILES.fullmatch(name) is not None or tokenizer_files.is_tokenizer_file(name)


def check_format(format: str | Iterable[str], *, gguf_dtype: str = "f32") -> tuple[str, bool]:  # noqa: A002
    """``(main format, whether a GGUF file is written)`` for ``save_pretrained``'s ``format``, checked.

    Raises:
        ValueError: If a value is not one of :data:`FORMATS`, both "hf" and "decilm" are given, or ``gguf_dtype``
            is not a GGUF type this writer knows.
    """
    values = [format] if isinstance(format, str) else list(format)
    unknown = [v for v in values if v not in FORMATS]
    if unknown or not values:
        raise ValueError(
            f"save_pretrained: `format` must be one of {list(FORMATS)} or a list of them (e.g. ['decilm', 'gguf']), "
            f"got {format!r}."
        )
    if "hf" in values and "decilm" in values:
        raise ValueError(
            "save_pretrained: `format` holds both 'hf' and 'decilm'; the directory has one config.json, so choose "
            "one of them ('gguf' may go with either)."
        )
    if "gguf" in values:
        from lightning_pat.export.gguf import check_dtype

        check_dtype(gguf_dtype)
    return ("decilm" if "decilm" in values else "hf"), "gguf" in values


def _read_from(model: nn.Module | None, tokenizer: object = None) -> list[tuple[str, object]]:
    """``(what, path)`` of what an export of ``model`` was read from: the model's and the tokenizer's directories."""
    config = getattr(model, "config", None)
    found: list[tuple[str, object]] = [("the model", getattr(config, "_name_or_path", None))]
    found.append(("the model", getattr(model, SOURCE_ATTR, None)))  # a module export load_pretrained read
    if isinstance(tokenizer, (str, Path)) and tokenizer != "auto":
        found.append(("the tokenizer", tokenizer))
    elif tokenizer is not None and not isinstance(tokenizer, str):
        found.append(("the tokenizer", getattr(tokenizer, "name_or_path", None)))
    return found


def check_directory(
    directory: str | Path,
    *,
    overwrite: bool,
    model: nn.Module | None = None,
    tokenizer: object = None,
    option: str = "overwrite=True",
    sources: Sequence[tuple[str, object]] = (),
) -> None:
    """Raise now what :func:`save_pretrained` would raise about ``directory`` (before a long computation).

    Args:
        directory: The export directory.
        overwrite: Whether an earlier export there may be replaced.
        model: The model to be exported (the directory it was loaded from is refused as an output).
        tokenizer: The tokenizer to be exported (likewise).
        option: How the caller spells ``overwrite=True`` (``--overwrite``, ``export_overwrite``), for the message.
        sources: ``(what it is, path)`` of other files or directories the export is made from (``lightning-pat
            shrink``: the checkpoint and the run's config), refused as an output likewise.

    Raises:
        ValueError: If ``directory`` is, or holds, the directory ``model`` or ``tokenizer`` was read from, or one of
            ``sources``.
        FileExistsError: If ``directory`` is not empty and ``overwrite`` is false, holds files that are not part
            of an export, or was not written by lightning_pat.
    """
    check_output(
        directory, overwrite=overwrite, replaceable=is_export_file, what="save_pretrained", owner_marks=_OWNER_MARKS,
        protected=[*_read_from(model, tokenizer), *sources], option=option,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- save
def save_pretrained(
    model: nn.Module,
    directory: str | Path,
    *,
    overwrite: bool = False,
    tokenizer: object = "auto",
    format: str | Iterable[str] = "hf",  # noqa: A002 - the name users know from serving tools
    gguf_dtype: str = "f32",
) -> Path:
    """Write a (shrunk) model so that :func:`load_pretrained` (and, where possible, stock tools) can load it.

    Args:
        model: A Hugging Face ``PreTrainedModel`` or any ``nn.Module``.
        directory: Output directory (created if needed; must be empty or absent unless ``overwrite``).
        overwrite: Replace an earlier export of lightning_pat in ``directory`` (a directory holding other files, or
            not written by lightning_pat, is still refused; so is the directory the model or tokenizer came from).
        tokenizer: The tokenizer written next to the model: a tokenizer object (``save_pretrained(dir)``), a
            directory to copy its tokenizer files from, ``None`` for none, or ``"auto"``: the tokenizer files of the
            directory the model was loaded from (``config.name_or_path``), if it is a local one holding them.
        format: ``"hf"`` (the stock Hugging Face layout, plus a ``lightning_pat`` config entry for shapes its config
            cannot express), ``"decilm"`` (Llama family: a DeciLM ``nemotron-nas`` config with per-layer KV groups
            and MLP widths, which vLLM serves with ``trust_remote_code=True``; see
            :mod:`lightning_pat.export.decilm`), and/or ``"gguf"`` (Llama family: ``model.gguf`` for llama.cpp next
            to the main format, with the tokenizer embedded; :mod:`lightning_pat.export.gguf`). A list combines
            them: ``["decilm", "gguf"]``.
        gguf_dtype: The GGUF tensor type: ``"f32"``, ``"f16"``, ``"bf16"``, ``"q8_0"``, ``"q4_0"``, ``"q4_1"``,
            ``"q5_0"`` or ``"q5_1"``.

    Returns:
        The directory.

    Raises:
        ValueError: If a Hugging Face model's shapes are not expressible by its config and the config it was built
            from cannot be rebuilt, or a module holds state the safe format cannot describe (nothing is
            ever pickled; the messages name the class or attribute and the fix); if ``format`` or ``gguf_dtype`` is not
            one of the values above, "decilm"/"gguf" is asked of a model that is not a ``LlamaForCausalLM`` (or
            has biases, RMSNorm eps that differ, a RoPE scaling for GGUF), DeciLM is asked of a model whose
            query-head count differs between layers, GGUF without a byte-level BPE tokenizer whose pre-tokenizer
            llama.cpp names, or ``tokenizer`` is neither a tokenizer object nor a directory holding one, or has
            more token ids than the model's embedding rows; if ``directory`` is (or holds) the directory the
            model or its tokenizer was read from.
        FileExistsError: If ``directory`` is not empty and ``overwrite`` is false, or holds files that are not part
            of an export, or was not written by lightning_pat.
        ModuleNotFoundError: If "gguf" is asked and the ``gguf`` package is not installed.
    """
    directory = Path(directory)
    what = "save_pretrained"
    main, with_gguf = check_format(format, gguf_dtype=gguf_dtype)
    is_hf = hf_entry.is_hf(model)
    if (main == "decilm" or with_gguf) and not is_hf:
        raise ValueError(
            f"save_pretrained: format {format!r} writes Llama-family Hugging Face models; {type(model).__name__} is "
            "not one. Use the default format='hf'."
        )
    deci_config = None
    if main == "decilm":
        deci_config = decilm.config_dict(read_layout(model, what=f"{what}(format='decilm')"), what=what)
    if with_gguf:
        from lightning_pat.export.gguf import layout_for_gguf

        layout_for_gguf(model, what=f"{what}(format='gguf')")
    source = tokenizer_files.resolve(tokenizer, model, what=what) if is_hf or tokenizer != "auto" else None
    if with_gguf and source is None:
        raise ValueError(
            "save_pretrained(format='gguf'): a GGUF file embeds the tokenizer, and none was found; pass tokenizer= "
            "(a tokenizer object, or the directory holding tokenizer.json)."
        )
    if source is not None:
        tokenizer_files.check_fits(source, model, what=what)
    marks, protected = _OWNER_MARKS, _read_from(model, tokenizer if source is None else source.directory or tokenizer)
    with atomic_directory(
        directory, overwrite=overwrite, replaceable=is_export_file, what=what, owner_marks=marks, protected=protected
    ) as tmp:
        if deci_config is not None:
            _save_decilm(model, tmp, deci_config)
        elif is_hf:
            _save_hf(model, tmp, destination=directory)
        else:
            _save_module(model, tmp)
        if is_hf:
            marker = {"written_by": "lightning_pat.save_pretrained", "format": main, "gguf": with_gguf}
            (tmp / EXPORT_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if source is not None:
            tokenizer_files.write(source, tmp, what=what)
        if with_gguf:
            from lightning_pat.export.gguf import GGUF_FILE, write_gguf

            write_gguf(model, tmp / GGUF_FILE, tokenizer_dir=tmp, dtype=gguf_dtype, what=f"{what}(format='gguf')")
    return directory


def _save_with_base_config(model: nn.Module, directory: Path, *, module_names: bool = False) -> None:
    """``model.save_pretrained`` under the config it was built from; the caller writes ``config.json`` afterwards.

    transformers validates the config it writes; the weights are written as they are. ``module_names``: the tensors
    under the model's own parameter names (what :func:`load_pretrained` reads back), not the checkpoint names
    transformers converts some families to (Mixtral's fused experts back to one tensor per expert).
    """
    _, base_config = hf_entry.base_config(model)
    hf = cast("PreTrainedModel", model)
    shrunk_config = hf.config
    hf.config = base_config
    try:
        if module_names:
            hf.save_pretrained(directory, save_original_format=False)
        else:
            hf.save_pretrained(directory)
    finally:
        hf.config = shrunk_config


def _save_decilm(model: nn.Module, directory: Path, config: Mapping[str, Any]) -> None:
    _save_with_base_config(model, directory)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    (directory / decilm.CONFIG_MODULE_FILE).write_text(decilm.config_module_source())
    layers = len(config["block_configs"])
    log.info("save_pretrained: DeciLM export (%d layers); vLLM: LLM(model=..., trust_remote_code=True)", layers)


def _save_hf(model: nn.Module, directory: Path, *, destination: Path) -> None:
    entry = hf_entry.record(model)
    hf = cast("PreTrainedModel", model)
    if entry is None:
        hf.save_pretrained(directory)
        log.info("save_pretrained: %s is expressible by its stock config; no lightning_pat entry", type(model).__name__)
        return
    cls = type(model)
    _save_with_base_config(model, directory, module_names=True)  # read back only by load_pretrained
    config = {**hf.config.to_dict(), "architectures": [cls.__name__], ENTRY: entry}
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    log.warning(
        "save_pretrained: the stock %s config cannot express this model (%s); load it with "
        "lightning_pat.load_pretrained(%r)%s",
        cls.__name__,
        entry["why"][0],
        str(destination),  # not the temporary directory the export is built in
        " (format='decilm' writes a config vLLM serves)" if cls.__name__ == "LlamaForCausalLM" else "",
    )


def _save_module(model: nn.Module, directory: Path) -> None:
    config = getattr(model, "config", None)
    info: dict[str, Any] = {
        "loader": LOADER,
        "version": _MODULE_VERSION,
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "shapes": hf_entry.shapes(model),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        info["config"] = dataclasses.asdict(config)
    try:
        description, tensors = describe(model)
    except UnsupportedStateError as err:
        raise ValueError(
            f"save_pretrained: the safe export format cannot store {err}: it stores plain values (numbers, strings, "
            "tuples, lists, dicts, dtypes, dataclasses), tensors and submodules, and lightning_pat never pickles a "
            "module. Keep such state out of the module (e.g. a function as a method or an nn.Module such as nn.Tanh)."
        ) from None
    from safetensors.torch import save_file

    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    info.update(format="safetensors", file=WEIGHTS_FILE, modules=description["modules"])
    (directory / SIZES_FILE).write_text(json.dumps(info, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------------- load
def load_pretrained(directory: str | Path, *, classes: Iterable[type] = ()) -> nn.Module:
    """Load anything :func:`save_pretrained` wrote (and plain Hugging Face model directories), without running code.

    Args:
        directory: The export directory.
        classes: Module (and dataclass config) classes the export may name besides ``torch.nn``, ``lightning_pat``
            ``transformers`` and ``lightning`` classes: your own ``nn.Module`` / LightningModule subclasses.

    Returns:
        The model, in eval mode for Hugging Face exports (as ``from_pretrained`` returns it).

    Raises:
        FileNotFoundError: If the directory holds neither ``config.json`` nor ``lightning_pat.json`` (naming the
            leftover folders of an overwrite killed half-way, if any: see
            :func:`~lightning_pat.core.safe_io.interrupted_overwrite`).
        ValueError: If the saved shapes and the loaded weights disagree, the export's version is unknown, a class is
            not allowed, a file name leads outside the directory, a file or field is malformed (one message naming
            the file and the field; shapes are checked against the safetensors headers before anything is built),
            or the export is a pickled ``model.pt`` (lightning_pat never unpickles; the message says how to convert
            it).
    """
    directory = Path(directory)
    if (directory / SIZES_FILE).is_file():
        return _load_module(directory, classes=list(classes))
    interrupted = interrupted_overwrite(directory)
    if interrupted is not None:
        raise FileNotFoundError(f"load_pretrained: {directory} does not exist: {interrupted}")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"load_pretrained: {directory} holds neither config.json nor {SIZES_FILE}; pass a directory written by "
            "lightning_pat.save_pretrained or by a transformers model's save_pretrained."
        )
    import transformers

    config = read_json(directory, "config.json")
    weights = _weight_files(directory)  # every name confined, before transformers opens anything
    if decilm.is_decilm(config):  # read as data: the export's configuration_decilm.py is never imported
        deci = decilm.entry_from_config(config)
        model = _build(transformers, deci, weights, directory, where=f"{directory / 'config.json'} (DeciLM)")
        hf_entry.record(model)  # per-layer widths: the entry that lets save_pretrained(model) write it again
        return model.eval()
    entry = config.get(ENTRY)
    if entry is None:
        arch = (config.get("architectures") or [None])[0]
        cls = _hf_class(transformers, arch) if arch else transformers.AutoModelForCausalLM
        loaded: nn.Module = load_hf_class(cls, directory, what="load_pretrained", use_safetensors=True)
        return loaded
    if not isinstance(entry, Mapping) or entry.get("version") != _VERSION:
        version = entry.get("version") if isinstance(entry, Mapping) else entry
        raise ValueError(f"load_pretrained: export version {version!r} is not {_VERSION}; upgrade.")
    where = f"{directory / 'config.json'}'s {ENTRY} entry"
    check_entry(entry, where)
    model = _build(transformers, entry, weights, directory, where=where)
    hf_config = cast("PretrainedConfig", model.config)
    hf_config.update({k: v for k, v in config.items() if k not in (ENTRY, "transformers_version", "architectures")})
    setattr(hf_config, ENTRY, dict(entry))  # the model's own save_pretrained writes it again
    return model.eval()


def _build(transformers: Any, entry: Mapping[str, Any], files: list[Path], directory: Path, *, where: str) -> nn.Module:
    """The model an entry describes (``class``, ``base_config``, ``shapes``, ``attributes``), with its weights.

    The entry's shapes are checked against the safetensors headers before anything of those shapes is built.
    """
    cls = _hf_class(transformers, entry["class"])
    check_shapes(entry["shapes"], files, where)
    state = _read_safetensors(files)
    try:
        base_config = cast("type[PretrainedConfig]", cls.config_class).from_dict(copy.deepcopy(entry["base_config"]))
        model = hf_entry.build_empty(cls, base_config)
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as err:  # what a crafted config raises
        raise ValueError(
            f"load_pretrained: {where}: no {cls.__name__} can be built from `base_config` ({type(err).__name__}: "
            f"{str(err)[:200]}); write the export again."
        ) from None
    attributes = entry_attributes(model, entry.get("attributes", {}))  # checked before anything is set
    _materialize(model, entry["shapes"], state)
    for module, key, value in attributes:
        old = getattr(module, key, None)
        setattr(module, key, tuple(value) if isinstance(old, tuple) else value)
    setattr(model, BASE_CONFIG_ATTR, entry["base_config"])
    hf_config = cast("PretrainedConfig", model.config)
    hf_config._name_or_path = str(directory)  # as from_pretrained: save_pretrained(tokenizer="auto") finds it
    return model


def _hf_class(transformers: Any, name: object) -> type[PreTrainedModel]:
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(f"load_pretrained: config.json names {name!r}, which is not a transformers model class.")
    return cast("type[PreTrainedModel]", cls)


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files transformers would read: ``model.safetensors``, else the shards of the index."""
    if (directory / WEIGHTS_FILE).exists():
        return [confined(directory, WEIGHTS_FILE, what="load_pretrained")]
    index = directory / INDEX_FILE
    if not index.exists():
        return []
    weight_map = read_json(directory, INDEX_FILE).get("weight_map")
    if not isinstance(weight_map, Mapping):
        raise ValueError(f"load_pretrained: {index} has no `weight_map`.")
    names = sorted(set(weight_map.values()), key=str)
    return [confined(directory, name, what=f"load_pretrained: {INDEX_FILE}") for name in names]


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not files:
        raise ValueError(f"load_pretrained: the export holds no {WEIGHTS_FILE} and no {INDEX_FILE}.")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            state.update(load_file(path))
        except Exception as err:  # noqa: BLE001 - SafetensorError and others on bytes that passed the header check
            raise ValueError(f"load_pretrained: cannot read {path} ({type(err).__name__}: {err}).") from None
    return state


def _materialize(model: nn.Module, shapes: Mapping[str, list[int]], state: Mapping[str, torch.Tensor]) -> None:
    """Give every (meta) parameter a real tensor of its saved shape, filled from ``state``; ties are kept."""
    groups: dict[int, list[str]] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, param in params.items():
        groups.setdefault(id(param), []).append(name)
    if set(shapes) != set(params):
        raise ValueError(
            f"load_pretrained: the export lists parameters {sorted(set(shapes) ^ set(params))[:5]} that the rebuilt "
            "model does not have (or the reverse); the export does not belong to this transformers version's class."
        )
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, attr))
    for names in groups.values():
        source = next((state[n] for n in names if n in state), None)
        if source is None:
            raise ValueError(f"load_pretrained: no weights for {names} in the export's safetensors files.")
        if list(source.shape) != list(shapes[names[0]]):
            raise ValueError(
                f"load_pretrained: {names[0]} has shape {list(source.shape)} in the weights but {shapes[names[0]]} in "
                "config.json; the export is inconsistent."
            )
        old = params[names[0]]
        new = nn.Parameter(source.clone().contiguous(), requires_grad=old.requires_grad)
        for module, attr in owners[id(old)]:
            module._parameters[attr] = new


def _load_module(directory: Path, *, classes: list[type]) -> nn.Module:
    info = read_json(directory, SIZES_FILE)
    fmt = info.get("format")
    if fmt == "torch.save":
        _refuse_pickled(directory, info)
    elif fmt == "safetensors" and info.get("version") == _MODULE_VERSION:
        where = str(directory / SIZES_FILE)
        check_description(info, where)
        path = confined(directory, info.get("file"), what=f"load_pretrained: {SIZES_FILE} 'file'")
        check_shapes(info["shapes"], [path], where)
        try:
            model = rebuild(info, _read_safetensors([path]), classes=classes)
        except (KeyError, TypeError, AttributeError, IndexError, RuntimeError) as err:  # a net under the checks
            raise ValueError(f"load_pretrained: {where} is malformed ({type(err).__name__}: {err}).") from None
    else:
        raise ValueError(
            f"load_pretrained: {directory / SIZES_FILE} has format {fmt!r} version {info.get('version')!r}; this "
            f"lightning_pat reads format 'safetensors' version {_MODULE_VERSION}; upgrade."
        )
    if not isinstance(model, nn.Module) or hf_entry.shapes(model) != info.get("shapes"):
        raise ValueError(
            f"load_pretrained: {directory} does not hold the module {SIZES_FILE} describes "
            f"({info.get('class')}); write the export again with save_pretrained."
        )
    setattr(model, SOURCE_ATTR, str(directory))  # save_pretrained never writes over it
    return model


def _refuse_pickled(directory: Path, info: Mapping[str, Any]) -> NoReturn:
    """Refuse a version-1 export (a pickled ``model.pt``): lightning_pat never unpickles (DESIGN rule 10)."""
    name = info.get("file", MODULE_FILE)
    path = confined(directory, name, what=f"load_pretrained: {SIZES_FILE} 'file'")
    raise ValueError(
        f"load_pretrained: {path} is a pickled module ({directory / SIZES_FILE} says format 'torch.save', version "
        f"{info.get('version')!r}: written by lightning_pat before 0.2 or with the removed unsafe_pickle=True). "
        "lightning_pat never unpickles a file, since unpickling runs any code it contains. If you wrote this file "
        "yourself or trust its source, convert it once in your own code: load the module with torch.load (telling "
        "torch to unpickle full objects, at your own risk), then `lightning_pat.save_pretrained(model, new_dir)`, "
        "which writes safetensors and JSON."
    )
