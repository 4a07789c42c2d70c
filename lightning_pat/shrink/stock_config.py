"""Whether a Hugging Face model's stock config can express a cut, asked before anything is pruned.

Some families derive a size from others (the head size from ``hidden_size // num_attention_heads`` in GPT-NeoX,
OPT, GPT-2; the MLP width from ``4 * hidden_size`` in Bloom and MPT), so a config with the new counts builds other
shapes and stock ``from_pretrained`` cannot load the shrunk model. :func:`stock_refusals` cuts half the units of
every cluster (the last half of each unit group) of a meta copy, lets the shrink update its config as it always
does, builds the model's class from that config on the meta device and compares the shapes: a declaration whose
members come out with other shapes is one the stock config cannot express. ``clusters="auto"`` leaves those out, and
says so (:func:`stock_expressible`). A module holding one Hugging Face model (the LightningModule the callback is
given) is probed through it: the held model's class is rebuilt from its config.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from lightning_pat.core.spec import Cluster, ResolvedCluster, resolve_clusters
from lightning_pat.shrink import verify
from lightning_pat.shrink.plan import build_plan
from lightning_pat.shrink.surgery import apply_plan

log = logging.getLogger(__name__)


def _half(rc: ResolvedCluster) -> list[int]:
    """The last half of each of the cluster's unit groups (none where a group has a single unit)."""
    groups = max(1, rc.unit_groups)
    per = rc.num_units // groups
    return [g * per + u for g in range(groups) for u in range(per - per // 2, per)] if per >= 2 else []


def stock_refusals(model: nn.Module, clusters: Sequence[Cluster]) -> dict[str, str]:
    """Declaration name -> why the stock config of ``model`` cannot express its cut.

    Empty if it can express every cut, or if ``model`` is not a Hugging Face model (no ``config.to_dict`` or
    ``save_pretrained``) and holds none or several (outermost ones), or has no meta copy to probe (a model FSDP2 has
    sharded already: probed before it was sharded where "auto" resolves it early; the shrink and ``save_pretrained``
    still check the stock config's shapes at export).

    Args:
        model: The model, or a module holding one (a LightningModule), before anything is pruned.
        clusters: The declarations (each resolved against ``model``).
    """
    if not clusters or hf_model(model) is None:
        return {}
    refused, orphans = _probe(model, clusters)
    if orphans and len(clusters) == 1:  # the one cut changed a field that other modules read too
        refused.setdefault(clusters[0].name, orphans[0])
    elif orphans:  # a field read by modules of another kind (RecurrentGemma's head count sizes its LRU blocks)
        # the culprits: the declarations whose cut alone changes such parameters, not counting those another
        # declaration holds (two MLP stacks sharing one width each resize the other alone; Phi-4-multimodal's audio
        # heads set its hidden size); none alone: every declaration
        held = {m.name for rc in resolve_clusters(model, list(clusters)) for m in rc.members}
        culprits = [d.name for d in clusters if _probe(model, [d], held=held)[1]]
        for name in culprits or [d.name for d in clusters]:
            refused.setdefault(name, orphans[0])
    return refused


def _is_hf(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return callable(getattr(config, "to_dict", None)) and callable(getattr(module, "save_pretrained", None))


def hf_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(name, module)`` of the Hugging Face model ``model`` is (``""``) or holds (the one outermost), else ``None``.

    Example::

        >>> hf_model(nn.Linear(2, 2)) is None
        True
    """
    if _is_hf(model):
        return "", model
    found = [(n, m) for n, m in model.named_modules() if n and _is_hf(m)]
    outer = [(n, m) for n, m in found if not any(n.startswith(f"{o}.") for o, _ in found)]
    return outer[0] if len(outer) == 1 else None


def _cut_and_build(
    model: nn.Module, resolved: Sequence[ResolvedCluster], path: str = ""
) -> tuple[nn.Module, dict[str, Any]]:
    """A meta copy of ``model`` with half of each of ``resolved`` cut, and the shapes its stock class builds.

    The class is that of the Hugging Face model at ``path`` (``model`` itself where ``""``), built on meta from the
    config the cut updated; the shapes are named as in ``model``.

    Raises:
        Exception: Whatever the copy, the cut or the stock build raises.
    """
    twin = verify.meta_copy(model)
    plan = build_plan(list(resolved), {rc.name: _half(rc) for rc in resolved})
    apply_plan(twin, plan, check_zeros=False, record=False)  # the config's fields only: no export entry
    hf = twin.get_submodule(path)
    with torch.device("meta"):
        stock = type(hf)(hf.config)
    prefix = f"{path}." if path else ""
    return twin, {prefix + n: tuple(p.shape) for n, p in stock.named_parameters(remove_duplicate=False)}


def tied_declarations(model: nn.Module, clusters: Sequence[Cluster]) -> list[list[str]]:
    """The declarations whose widths one stock config field sets, as groups of two or more declaration names.

    Jamba's ``intermediate_size`` is the width of its dense MLPs and of its experts' channels: two declarations whose
    kept widths must agree, or stock ``from_pretrained`` builds one of them at the other's width. A declaration is
    cut alone (half of each of its clusters, on a meta copy) and the model's class is built on meta from the config
    the shrink updated: another declaration whose members then come out with other shapes is tied to it. Only
    declarations with a unit count in common with another are probed (a tie between different counts already shows
    in :func:`stock_refusals`' probe of every cut), one probe each, none for a declaration found tied already nor
    for the last one (its ties show in the others' probes). Empty for a model that is not a Hugging Face model.

    Args:
        model: The model (or a module holding it), before anything is pruned.
        clusters: The declarations (each resolved against ``model``; a name two declarations share is given as
            ``name#i``, ``i`` its index in ``clusters``).
    """
    found = hf_model(model)
    if len(clusters) < 2 or found is None:
        return []
    path = found[0]
    names = [d.name for d in clusters]
    if len(set(names)) < len(names):  # one name for two declarations: one label, one width already
        names = [f"{d.name}#{i}" if names.count(d.name) > 1 else d.name for i, d in enumerate(clusters)]
    resolved = {n: resolve_clusters(model, [d]) for n, d in zip(names, clusters, strict=True)}
    counts = {name: {rc.num_units for rc in rcs} for name, rcs in resolved.items()}
    candidates = [n for n in resolved if any(counts[n] & counts[o] for o in resolved if o != n)]
    axes = {n: {(m.name, m.dim) for rc in resolved[n] for m in rc.members} for n in candidates}
    group = {n: n for n in resolved}  # union-find: a name -> its group's first name

    def root(name: str) -> str:
        while group[name] != name:
            name = group[name]
        return name

    probed: set[str] = set()
    for name in candidates:  # the last one too: only one of two tied declarations may write the field
        if any(root(name) == root(p) for p in probed):
            continue  # tied to a declaration probed already: its ties showed there
        probed.add(name)
        try:
            twin, want = _cut_and_build(model, resolved[name], path)
        except verify.MetaCopyError:
            return []  # no meta copy to probe (see stock_refusals): no tie known
        except Exception:  # noqa: BLE001 - a cut the stock config refuses: stock_refusals says so, no tie known
            continue
        shapes = {n: tuple(p.shape) for n, p in twin.named_parameters(remove_duplicate=False)}
        for other in candidates:
            if other != name and any(
                key not in axes[name] and p in want and len(want[p]) == len(shapes[p]) and want[p][d] != shapes[p][d]
                for key in axes[other]
                for p, d in [key]
            ):
                a, b = sorted((root(name), root(other)), key=list(resolved).index)
                group[b] = a
    groups: dict[str, list[str]] = {}
    for name in resolved:
        groups.setdefault(root(name), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _probe(
    model: nn.Module, clusters: Sequence[Cluster], *, held: frozenset[str] | set[str] = frozenset()
) -> tuple[dict[str, str], list[str]]:
    """:func:`stock_refusals` of one probe, and why parameters in no declaration changed shape (nobody blamed).

    ``held``: parameters of other declarations, whose changed shapes are not counted as orphans.
    """
    prefix, hf = cast(tuple[str, nn.Module], hf_model(model))  # stock_refusals checked it
    config: Any = hf.config
    under = f"{prefix}." if prefix else ""
    owners: dict[str, dict[str, set[int]]] = {}  # parameter -> declaration -> the dims it cuts there
    resolved: list[ResolvedCluster] = []
    for decl in clusters:
        for rc in resolve_clusters(model, [decl]):
            resolved.append(rc)
            for m in rc.members:
                owners.setdefault(m.name, {}).setdefault(decl.name, set()).add(m.dim)
    try:
        twin, want = _cut_and_build(model, resolved, prefix)
    except verify.MetaCopyError as err:  # a sharded module: not probed (see stock_refusals)
        log.info("clusters='auto': the stock config of %s is not probed (%s)", type(model).__name__, err)
        return {}, []
    except Exception as err:  # noqa: BLE001 - any failure of the probe: nothing is known to be expressible
        if len(clusters) > 1:  # one declaration's cut may break the probe (heads): each probed alone
            return {k: v for decl in clusters for k, v in stock_refusals(model, [decl]).items()}, []
        reason = f"the probe of its stock config failed ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
        return dict.fromkeys((c.name for c in clusters), reason), []
    refused: dict[str, str] = {}
    orphans: list[str] = []
    for name, p in twin.named_parameters(remove_duplicate=False):
        if want.get(name) == tuple(p.shape) or not name.startswith(under):  # outside the held model: not its config's
            continue
        built = list(want.get(name, ()))
        why = f"{type(config).__name__} with the new sizes builds {name} as {built}, not {list(p.shape)}"
        # a parameter in no cluster that the new config resizes (one MLP width for two stacks of layers, one of
        # them cut): the clusters holding the same kind of parameter changed the config field
        # only a declaration that cuts a dim that came out wrong (a cut of the rows is not blamed for the columns
        # another cut's config field resized: Phi-4-multimodal's audio heads once set its hidden size; Zamba 2's
        # down_proj: its columns the MLP's, its rows those of the block's output, whose rows came out wrong)
        wrong = {d for d, (a, b) in enumerate(zip(built, p.shape, strict=False)) if a != b} or set(range(p.dim()))
        suffix = "." + ".".join(name.split(".")[-3:])
        cutters = owners.get(name) or {d: ds for n, by in owners.items() if n.endswith(suffix) for d, ds in by.items()}
        culprits = {d for d, dims in cutters.items() if dims & wrong}
        for culprit in culprits:
            refused.setdefault(culprit, why)
        if not culprits and name not in held:
            orphans.append(why)
    return refused, orphans


def head_count_multiple(model: nn.Module, num_heads: int, fields: Sequence[str]) -> int:
    """The smallest ``m`` dividing ``num_heads`` whose every multiple up to ``num_heads`` the stock config accepts.

    Some configs refuse head counts themselves (DeepSeek-V2's validator: the hidden size must be a multiple of the
    head count), which a meta probe of one cut does not see; a heads cluster with ``multiple_of=m`` keeps only counts
    the config can hold. ``1`` where every count is accepted, where ``model`` has no Hugging Face config, or where
    the config refuses even the model's own count (nothing can be told then).

    Args:
        model: The model (its ``config`` is rebuilt with other head counts, never changed).
        num_heads: The head count of the model.
        fields: The config fields that hold the head count (all set to each count tried).
    """
    config: Any = getattr(model, "config", None)  # a transformers config (not a type imported here)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return 1
    base = to_dict()

    def accepted(count: int) -> bool:
        try:
            type(config)(**{**base, **dict.fromkeys(fields, count)})
        except Exception:  # noqa: BLE001 - any refusal of the config class
            return False
        return True

    if not accepted(num_heads):
        return 1
    return next(m for m in range(1, num_heads + 1) if num_heads % m == 0 and all(map(accepted, range(m, num_heads, m))))


def stock_expressible(model: nn.Module, clusters: list[Cluster]) -> list[Cluster]:
    """``clusters`` without those :func:`stock_refusals` names; a warning lists what was left out and why.

    Raises:
        ValueError: If the stock config can express none of them.
    """
    refused = stock_refusals(model, clusters)
    if not refused:
        return clusters
    kept = [c for c in clusters if c.name not in refused]
    reasons = "; ".join(f"{n}: {why}" for n, why in list(refused.items())[:4])
    if not kept:
        raise ValueError(
            f"clusters='auto': the stock config of {type(model).__name__} can express none of the cuts found "
            f"({len(clusters)} clusters; {reasons}), so stock from_pretrained could not load a pruned model. Declare "
            "the clusters by hand (`clusters=lightning_pat.discover(model, example_input).clusters` takes every one "
            "found) and export with lightning_pat.save_pretrained / load_pretrained."
        )
    log.warning(
        "clusters='auto': %d of %d clusters of %s are not cut, because its stock config cannot express them (stock "
        "from_pretrained could not load the result): %s. Declare them by hand and export with "
        "lightning_pat.save_pretrained / load_pretrained to cut them anyway.",
        len(refused), len(clusters), type(model).__name__, reasons,
    )  # fmt: skip
    return kept
