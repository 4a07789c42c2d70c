"""``clusters=`` into cluster declarations: preset names expanded, ``"auto"`` resolved, discovery by tracing.

The callback's ``clusters`` (checked when :class:`~lightning_pat.pruning.options.PruningOptions` is built, by
:func:`normalize_clusters`) become declarations for a module at fit start (:func:`declarations_for`), or, for
``clusters="auto"`` on a model no preset covers, by tracing before the model is sharded (:func:`early_declarations`:
global rank 0 traces, :func:`traced_declarations`, and broadcasts the outcome).
:func:`~lightning_pat.prune_clusters` takes the same spellings without a Trainer (:func:`one_shot_declarations`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_pat import presets
from lightning_pat.core.layers import common_module_path
from lightning_pat.core.spec import Cluster, check_declaration, found_clusters, resolve_clusters
from lightning_pat.core.spec.patterns import split_slice
from lightning_pat.discovery import discovered_clusters, outcome_from_json, outcome_to_json, prefers_discovery
from lightning_pat.parallel.comm import ranks
from lightning_pat.presets.registry import expand as expand_presets
from lightning_pat.pruning.tied_widths import layer_template, stock_clusters
from lightning_pat.shrink.model_meta import NAMED_WIDTHS

_FIELDS = tuple(f.name for f in dataclasses.fields(Cluster))
log = logging.getLogger(__name__)


def _preset_name(name: str) -> str:
    try:
        presets.get(name)
    except ValueError as err:
        raise ValueError(f"`clusters`: {err}") from err
    return name


def _declaration(entry: object, index: int) -> Cluster:
    if isinstance(entry, Mapping):
        label = entry.get("name", f"#{index}")
        unknown = sorted(str(k) for k in entry if k not in _FIELDS)
        if unknown:
            raise ValueError(
                f"Cluster {label!r}: unknown key(s) {unknown}; a cluster declaration has the fields {list(_FIELDS)}."
            )
        if "name" not in entry:
            raise ValueError(
                f"Cluster #{index}: the mapping {dict(entry)!r} has no `name`; every declaration needs one."
            )
    elif not isinstance(entry, Cluster):
        raise ValueError(
            f"`clusters` entry #{index} must be a Cluster, a mapping of its fields or a preset name, got "
            f"{type(entry).__name__} ({entry!r})."
        )
    try:
        return check_declaration(entry if isinstance(entry, Cluster) else Cluster(**entry))
    except (ValueError, TypeError) as err:
        raise ValueError(f"`clusters`: {err}") from err


def normalize_clusters(clusters: object) -> str | tuple[Cluster | str, ...]:
    """A preset name (checked), or declarations and preset names (checked; mappings become Clusters).

    Raises:
        ValueError: If ``clusters`` is empty or of the wrong type, a preset name is unknown, or a declaration is
            invalid (a mapping with an unknown key or no name included).
    """
    clusters = found_clusters(clusters)  # a Discovery: its declarations
    if isinstance(clusters, str):
        return _preset_name(clusters)
    if isinstance(clusters, (Cluster, Mapping)):
        clusters = [clusters]
    if not isinstance(clusters, Sequence) or not clusters:
        raise ValueError(
            f"`clusters` must be a preset name or a non-empty list of Cluster declarations, got {clusters!r}."
        )
    return tuple(_preset_name(c) if isinstance(c, str) else _declaration(c, i) for i, c in enumerate(clusters))


def discovers(module: Any, clusters: object) -> bool:
    """Whether ``clusters="auto"`` means discovery by tracing for ``module`` (no preset covers it).

    A preset covers the module when :func:`~lightning_pat.presets.detect` finds a family whose layout holds every
    decoder layer and the family's preset builds its declarations; otherwise (a wrong family guess included) the
    clusters are discovered, and the log says which route was taken.
    """
    if not _is_auto(clusters):
        return False
    if prefers_discovery(module):
        return True
    try:
        presets.for_model(module)
    except ValueError as err:
        log.warning("clusters='auto': the preset does not fit %s (%s); discovering the clusters by tracing instead",
                    type(module).__name__, err)  # fmt: skip
        return True
    return False


def example_input(module: Any, batches: Sequence[Any] | None = None) -> Any:
    """What discovery traces: ``example_input_array``, else the first of ``batches``, else a few token ids.

    The token ids (``(2, 8)``, below ``config.vocab_size``) are made for a module whose own ``config`` has a
    ``vocab_size`` (a Hugging Face model), so that ``clusters="auto"`` needs no example from the user.

    Returns:
        The example input, or ``None`` if there is none.
    """
    example = getattr(module, "example_input_array", None)
    if example is None and isinstance(batches, Sequence) and not isinstance(batches, (str, bytes)) and batches:
        example = batches[0]
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if example is None and isinstance(vocab, int) and vocab > 0:
        example = (torch.arange(16).reshape(2, 8) * 7 + 3) % vocab
    return example


def declarations_for(
    module: Any, clusters: str | Sequence[Cluster | str], preset_options: Mapping[str, bool]
) -> list[Cluster]:
    """The cluster declarations for ``module``: the given ones, or the presets' (expanded from preset names).

    With ``clusters="auto"`` and a module no preset covers, they are discovered by tracing its
    ``example_input_array`` (:func:`~lightning_pat.discover`).

    Args:
        module: The model the declarations are for.
        clusters: ``PruningOptions.clusters`` (checked by :func:`normalize_clusters`).
        preset_options: ``PruningOptions.preset_options`` (checked when the options were built).

    Raises:
        ValueError: If ``preset_options`` are given with declarations only, or a preset does not fit the module;
            if discovery has no example input or fails.
    """
    if discovers(module, clusters):
        return _discovered(module, example_input(module), preset_options)
    out = expand_presets(clusters if isinstance(clusters, str) else list(clusters), module, preset_options)
    return stock_clusters(module, out) if _is_auto(clusters) else out


def traced_declarations(
    module: Any,
    clusters: str | Sequence[Cluster | str],
    preset_options: Mapping[str, bool],
    batch_input: Callable[[], Any],
) -> list[Cluster] | ValueError | None:
    """``clusters="auto"`` by tracing on this rank, before the model is sharded (FSDP2 modules cannot be copied).

    Args:
        module: The model, before ``configure_model``.
        clusters: ``PruningOptions.clusters``.
        preset_options: ``PruningOptions.preset_options``.
        batch_input: Returns the first training batch's inputs (``None`` if there is none); called only if the
            module has no ``example_input_array``.

    Returns:
        The discovered declarations; the ``ValueError`` that discovery raised (the caller raises it where every
        rank raises together); or ``None`` when discovery does not apply (declarations, a preset).
    """
    if not discovers(module, clusters):
        return None
    example = example_input(module)
    try:
        return _discovered(module, example if example is not None else batch_input(), preset_options)
    except ValueError as err:
        return err


def early_declarations(
    module: Any,
    clusters: str | Sequence[Cluster | str],
    preset_options: Mapping[str, bool],
    batch_input: Callable[[], Any],
) -> list[Cluster] | ValueError | None:
    """``clusters="auto"`` discovered by tracing before ``configure_model`` shards the model, agreed by every rank.

    Under torch.distributed only global rank 0 traces (:func:`traced_declarations`); every other rank receives its
    outcome (the declarations, an error, or nothing: JSON bytes in one broadcast, no pickle). A discovery error is
    returned, not raised: the training controller's ``bind`` raises it, where every rank raises together.

    Args:
        module: The model, before ``configure_model``.
        clusters: ``PruningOptions.clusters``.
        preset_options: ``PruningOptions.preset_options``.
        batch_input: Returns the first training batch's inputs (see :func:`traced_declarations`).

    Returns:
        As for :func:`traced_declarations`, the same on every rank.
    """
    mine: list[Cluster] | ValueError | None = None
    if ranks.world_rank() == 0:
        try:
            mine = traced_declarations(module, clusters, preset_options, batch_input)
        except Exception as err:  # noqa: BLE001 - the other ranks wait in the broadcast: send any error to them
            mine = ValueError(f"clusters='auto': discovery failed on rank 0 ({type(err).__name__}: {err})")
    group = ranks.world_group()
    return outcome_from_json(ranks.broadcast_json(outcome_to_json(mine), group=group))


def _discovery_query_heads(module: Any, preset_options: Mapping[str, bool]) -> bool | None:
    """``preset_options``' ``query_heads`` for discovery (the one option it reads); any other option raises."""
    others = {k: v for k, v in preset_options.items() if k != "query_heads"}
    if others:
        raise ValueError(
            f"`preset_options` {others} apply to presets, but no preset fits {type(module).__name__} and its clusters "
            "are discovered by tracing; remove `preset_options` (discovery reads `query_heads` only)."
        )
    return preset_options.get("query_heads")


def _discovered(module: Any, example: Any, preset_options: Mapping[str, bool]) -> list[Cluster]:
    """``clusters="auto"`` for a model no preset covers: trace ``example`` (see :mod:`lightning_pat.discovery`)."""
    if example is None:
        raise ValueError(
            f"clusters='auto': no preset fits {type(module).__name__}, and discovering the clusters by tracing "
            "needs an example input; set `self.example_input_array` in the LightningModule (what `forward` takes) "
            "or give `fit` training data, or declare the clusters (`lightning_pat.discover(model, example)` prints "
            "them)."
        )
    query_heads = _discovery_query_heads(module, preset_options)
    found = discovered_clusters(module, example, query_heads=query_heads)
    return stock_clusters(module, per_layer_declarations(module, found))


def _signature(model: Any, clusters: Sequence[Cluster]) -> dict[str, tuple[Any, ...]]:
    return {
        rc.name: (rc.num_units, rc.unit_groups, rc.multiple_of, tuple(rc.members))
        for rc in resolve_clusters(model, list(clusters))
    }


def _module_prefix(names: Sequence[str]) -> str:
    """The longest module path every one of ``names`` (parameters, slices allowed) lies under, or ``""``."""
    return common_module_path(split_slice(n)[0] for n in names)


def _one_width(model: Any, config: Any, clusters: list[Cluster]) -> list[Cluster]:
    """The clusters of low-rank blocks whose width one config field holds, as one declaration (one kept count).

    A stock config holds one rank for all of them (:data:`~lightning_pat.shrink.model_meta.NAMED_WIDTHS`: Qwen4-exp's
    ``hc_lowrank``, read by every hyper-connection, those of the attention, of the MLP and the final mixer), so a size
    target must keep the same count in each: the clusters whose members all lie under such a block, with the same
    members below it and the same unit count, become one declaration with a ``{site}`` group (checked to resolve to
    the same clusters; otherwise they stay as they are).
    """
    for field, part in NAMED_WIDTHS.items():
        if not isinstance(getattr(config, field, None), int):
            continue
        tied = [c for c in clusters if c.readers and all(part in m for m in (*c.writers, *c.readers))]
        sites = [_module_prefix([*c.writers, *c.readers]) for c in tied]
        if len(tied) < 2 or len({c.num_units for c in tied}) != 1 or not all(sites):
            continue
        below = {
            (tuple(w[len(s) :] for w in c.writers), tuple(r[len(s) :] for r in c.readers))
            for c, s in zip(tied, sites, strict=True)
        }
        if len(below) != 1:
            continue
        writers, readers = next(iter(below))
        alternation = "|".join(re.escape(s) for s in sites)

        def pattern(rest: str, alternation: str = alternation) -> str:
            name, sliced = split_slice(rest)[0], rest[len(split_slice(rest)[0]) :]
            return f"re:(?P<site>{alternation}){re.escape(name)}{sliced}"

        decl = dataclasses.replace(
            tied[0],
            name=f"{field}.{{site}}",
            writers=[pattern(w) for w in writers],
            readers=[pattern(r) for r in readers],
        )
        try:
            same = sorted(map(repr, _signature(model, [decl]).values())) == sorted(
                map(repr, _signature(model, tied).values())
            )
        except ValueError:
            same = False
        if same:
            log.info(
                "clusters='auto': %d clusters of %s's %r blocks keep one count (%s)",
                len(tied),
                type(model).__name__,
                part,
                field,
            )
            clusters = [c for c in clusters if c not in tied] + [decl]
    return clusters


def per_layer_declarations(model: Any, clusters: list[Cluster]) -> list[Cluster]:
    """Discovered clusters of a Hugging Face model, one declaration per kind across its layers where they repeat.

    Discovery returns one cluster per layer (``model.layers.0.mlp.c_fc``, ``model.layers.1.mlp.c_fc``, …); a stock
    config holds one MLP width and one head count, so a size target must keep one width per kind, as it does for the
    clusters of one preset declaration. The clusters that differ only in their layer index (same members, units,
    slices and options) become one declaration with a ``{layer}`` group (:func:`_layer_template`), which resolves to
    exactly the same clusters (checked; otherwise they stay as they are). The clusters of a model that holds no
    Hugging Face model are returned as they are.
    """

    def hf(m: Any) -> bool:
        return callable(getattr(getattr(m, "config", None), "to_dict", None)) and callable(
            getattr(m, "save_pretrained", None)
        )

    if not any(hf(m) for m in model.modules()):  # the model, or a LightningModule holding one
        return clusters
    clusters = _one_width(model, next(m.config for m in model.modules() if hf(m)), clusters)
    groups: dict[Any, list[Cluster]] = {}
    templates: dict[Any, Cluster] = {}
    order: list[Any] = []
    for i, cluster in enumerate(clusters):
        decl = layer_template(cluster)
        key: Any = ("alone", i) if decl is None else repr(decl)
        if key not in groups:
            order.append(key)
            groups[key] = []
            if decl is not None:
                templates[key] = decl
        groups[key].append(cluster)
    out: list[Cluster] = []
    for key in order:
        group = groups[key]
        decl = templates.get(key)
        if decl is not None and len(group) > 1:
            try:
                same = _signature(model, [decl]) == _signature(model, group)
            except ValueError:
                same = False
            if same:
                out.append(decl)
                continue
        out.extend(group)
    return out


def _is_auto(clusters: object) -> bool:
    return isinstance(clusters, str) and clusters.lower() == "auto"


def auto_declarations(
    module: Any,
    clusters: object,
    calibration: Sequence[Any] | None = None,
    preset_options: Mapping[str, bool] | None = None,
) -> object:
    """``clusters="auto"`` as the callback means it, for a call without a Trainer (``prune_clusters``).

    A preset that covers the module (see :func:`discovers`): its name stays (expanded by the caller). Otherwise the
    clusters are discovered by tracing :func:`example_input` (the module's ``example_input_array``, the first
    ``calibration`` batch, or token ids for a Hugging Face model); without any, an error points at
    :func:`~lightning_pat.discover`. Anything but ``"auto"`` is returned as it is. Discovery reads
    ``preset_options``' ``query_heads`` (GQA query heads inside their KV groups) and refuses the other options.

    Raises:
        ValueError: If no preset fits and there is no example input, discovery fails, or ``preset_options`` holds an
            option other than ``query_heads`` for a model no preset covers.
    """
    if not discovers(module, clusters):
        return clusters
    example = example_input(module, calibration)
    if example is None:
        raise ValueError(
            f"clusters='auto': no preset fits {type(module).__name__}, so its clusters are found by tracing, which "
            "needs an example input: `found = lightning_pat.discover(model, example_input)`, then "
            "`prune_clusters(model, found, ...)` (or set `model.example_input_array`, or pass `calibration`)."
        )
    query_heads = _discovery_query_heads(module, preset_options or {})
    found = discovered_clusters(module, example, query_heads=query_heads, encoders=True)
    return stock_clusters(module, per_layer_declarations(module, found))


def one_shot_declarations(
    module: Any,
    clusters: object,
    calibration: Sequence[Any] | None = None,
    preset_options: Mapping[str, bool] | None = None,
) -> Cluster | Mapping[str, Any] | Sequence[Cluster | Mapping[str, Any]]:
    """``prune_clusters``' ``clusters`` as the callback reads them: a discovery, ``"auto"`` and preset names expanded.

    Declarations pass through as they are (the plan resolves them).

    Raises:
        ValueError: As :func:`auto_declarations`, or if a preset name is unknown or rejects the module.
    """
    # a Discovery; "auto" as the callback means it (its example: the first calibration batch, if it needs one)
    options = dict(preset_options or {})
    auto = found_clusters(clusters)
    clusters = auto_declarations(module, auto, calibration, options)
    if isinstance(clusters, str) or (
        isinstance(clusters, Sequence)
        and not isinstance(clusters, Mapping)
        and any(isinstance(c, str) for c in clusters)
    ):  # preset names (e.g. "linear_chain", "auto"), as the callback accepts them
        out = expand_presets(clusters, module, options)
        return stock_clusters(module, out) if _is_auto(clusters) else out
    if options and not _is_auto(auto):
        raise ValueError(f"`preset_options` {options} apply to preset names and 'auto' only; none was given.")
    return clusters  # type: ignore[return-value]  # declarations as given; the plan checks each entry
