"""Find the coupled units of any model by tracing it: :func:`discover`.

The model is exported to an ATen graph (:mod:`lightning_pat.discovery.trace`) and every tensor dim that carries
channels gets a *label*: a list of segments ``(space, units, block)`` (a concatenation holds several). A *space* is
one index space of units (union-find): a Linear/Conv output channel axis opens one, with the weight's rows and the
bias as writers; channel-preserving ops (activations, dropout, pooling, BatchNorm, GroupNorm (a unit becomes a
whole group), elementwise ops, residual additions) carry the label on (an addition or product of two labelled
tensors joins their spaces); readers (a Linear's/Conv's input channels, an embedding's columns) join the space of
their input's label; ``flatten`` after a convolution turns a channel into a block of ``H*W`` consecutive columns;
grouped convolutions (depthwise included) and transposed convolutions are handled in
:mod:`lightning_pat.discovery.conv` (a unit is a whole group); ``cat`` along the channel axis puts segments side by
side; attention heads (a channel axis reshaped into heads, products of activations over the head axis, ``split``
of a packed QKV, GQA) in :mod:`lightning_pat.discovery.attention`.

Everything the walk does not understand *poisons* the spaces it touches, with a reason: the model's outputs
(logits are never pruned), ops that mix channels (LayerNorm over the channel axis, softmax or reductions over it, a
product of two activations summed over a channel axis, a reshape that puts a channel axis behind another axis),
parameters used directly in a forward (outside the weight slot of a Linear/Conv/norm), norms without affine weights,
grouped convolutions whose groups straddle concatenated parts or read the model's input.
Poisoned spaces are left out and listed in :attr:`Discovery.left_out`; the rest become ordinary :class:`Cluster`
declarations (exact names, channel slices where a member holds part of an axis, explicit ``num_units``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, cast

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from lightning_pat import presets
from lightning_pat.core.spec import Cluster, check_declaration, resolve_clusters
from lightning_pat.discovery import trial as trials
from lightning_pat.discovery.encoders import prefixed, untraced_encoders
from lightning_pat.discovery.query_heads import refine_query_heads
from lightning_pat.discovery.trace import TraceStop, trace
from lightning_pat.discovery.walk import Walk
from lightning_pat.heads import mha_refusal
from lightning_pat.presets.ssm import mixers
from lightning_pat.shrink.layer_config import layer_values

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeftOut:
    """Channels discovery did not turn into a cluster, and why.

    Attributes:
        name: A readable name (the first writer's module).
        units: Number of channels (units).
        members: The parameters (with channel slices) that touch these channels.
        reasons: Why the channels are left out.
    """

    name: str
    units: int
    members: tuple[str, ...]
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Discovery:
    """What :func:`discover` found.

    Attributes:
        clusters: The coupled clusters, ordinary declarations (print, edit, pass to the callback).
        left_out: Channels that touch parameters but are not safe to prune, with the reasons.
        example_input: The example input discovery traced (``shrink(model, result, example_input=found)`` checks
            the shrunk model on it).
    """

    clusters: list[Cluster]
    left_out: list[LeftOut]
    example_input: Any = field(default=None, repr=False, compare=False)

    def table(self) -> str:
        """A readable report: one line per cluster found and per group of channels left out."""
        lines = ["| channels | units | members | status |", "| --- | --- | --- | --- |"]
        for c in self.clusters:
            members = ", ".join([*c.writers, *c.readers])
            lines.append(f"| {c.name} | {c.num_units} | {_short(members)} | cluster |")
        for lo in self.left_out:
            lines.append(
                f"| {lo.name} | {lo.units} | {_short(', '.join(lo.members))} | left out: {'; '.join(lo.reasons)} |"
            )
        return "\n".join(lines)


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------- results
def _module_of(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else param


def _pattern(param: str, dim: int, start: int, stop: int, shapes: dict[str, tuple[int, ...]]) -> str:
    full = shapes.get(param)
    whole = full is not None and start == 0 and stop == full[dim]
    return param if whole else f"{param}[{start}:{stop}]"


def _collect(w: Walk, shapes: dict[str, tuple[int, ...]]) -> Discovery:
    by_root: dict[int, list[tuple[str, int, int, int]]] = {}
    for key, member_space in w.members.items():
        by_root.setdefault(w.find(member_space), []).append(key)
    for root, keys in by_root.items():
        for param, *_ in keys:
            if param in w.direct:
                w.poison_space(root, w.direct[param])
    clusters: list[Cluster] = []
    left: list[LeftOut] = []
    names: dict[str, int] = {}
    for root in sorted(by_root):
        keys = by_root[root]
        space = w.spaces[root]
        writers = [k for k in keys if k[1] == 0]  # the spec's roles: channel axis dim 0 (rows, 1-D) or dim 1
        readers = [k for k in keys if k[1] == 1]
        producers = [k for k in keys if w.flows[k] == "out"]
        producers.sort(key=lambda k: k[0] in w.scales)  # named after a writer module, not a scale vector
        reasons = list(space.reasons)
        if not reasons and len(producers) == len(keys):
            reasons.append("no Linear/Conv reads these channels")
        if not reasons and not producers:
            reasons.append("no Linear/Conv writes these channels")
        if not reasons and space.units < 2:
            reasons.append("a single channel")
        base = _module_of((producers or keys)[0][0])
        count = names.get(base, 0)
        names[base] = count + 1
        name = base if count == 0 else f"{base}#{count}"
        if reasons:
            members = tuple(_pattern(*k, shapes) for k in keys)
            left.append(LeftOut(name, space.units, members, tuple(reasons)))
            continue
        clusters.append(
            Cluster(
                name=name,
                writers=[_pattern(*k, shapes) for k in writers],
                readers=[_pattern(*k, shapes) for k in readers],
                num_units=space.units,
            )
        )
    return Discovery(clusters=clusters, left_out=left)


def discover(
    model: nn.Module, example_input: Any, *, check: trials.Check = "auto", query_heads: bool | None = None
) -> Discovery:
    """Trace ``model`` and derive its coupled clusters, and a report of the channels left out.

    Only clusters the shrink turns into a model that runs and equals the masked model are returned
    (:mod:`lightning_pat.discovery.trial`): each cluster passes the shrink's own validation (every member belongs to
    a module the shrink can rewrite), and a trial shrink of a copy that drops one unit of every cluster runs and
    matches the masked copy on ``example_input``. Whatever fails is left out with the reason.

    Args:
        model: Any module (a LightningModule traces its ``forward``); it is not changed or run on data (a meta copy
            is traced; the trial shrink runs a copy).
        example_input: What ``forward`` takes: a tensor, a tuple of positional arguments, or a dict of keyword
            arguments (``LightningModule.example_input_array``, a batch's inputs).
        check: The trial shrink: ``"values"`` (a CPU copy with random weights and the model's buffers, masked vs
            shrunk outputs compared), ``"meta"`` (a meta copy: the shrunk model only has to run), ``"none"``, or
            ``"auto"`` (default: values up to 2**28 parameters, meta above).
        query_heads: GQA attention of a transformers model: one unit per query head inside its KV group instead of
            a whole query group (see :mod:`lightning_pat.discovery.query_heads`); default: the presets' default
            (:data:`lightning_pat.presets.QUERY_HEADS_DEFAULT`).

    Returns:
        The clusters (exact parameter names, channel slices where needed, explicit ``num_units``), the channels
        left out with the reasons (``Discovery.table()`` prints both), and the example input.

    Raises:
        ValueError: If the example input does not fit the forward (the message names the module that raised), the
            model cannot be traced (the message says why and suggests declaring clusters), or ``check`` is not one
            of the values above.

    Example::

        >>> import torch
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
        >>> found = discover(net, torch.zeros(1, 3, 8, 8))
        >>> [(c.writers, c.readers) for c in found.clusters]
        [(['0.weight', '0.bias', '1.weight', '1.bias'], ['3.weight'])]
    """
    if check not in ("auto", "values", "meta", "none"):
        raise ValueError(f"discover: `check` must be 'auto', 'values', 'meta' or 'none', got {check!r}.")
    tr = trace(model, example_input)
    walk = Walk(tr)
    walk.run()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    found = _collect(walk, shapes)
    found = replace(found, left_out=[*found.left_out, *_opaque(model, tr.opaque)])
    if presets.QUERY_HEADS_DEFAULT if query_heads is None else query_heads:
        found = Discovery(refine_query_heads(model, found.clusters), found.left_out)
    found = _multihead_attention(model, _validated(model, found), tr.refused)
    return replace(_tried(model, found, example_input, check), example_input=example_input)


def _opaque(model: nn.Module, reasons: Mapping[str, str]) -> list[LeftOut]:
    """The modules traced as opaque selections (:attr:`~lightning_pat.discovery.trace.Trace.opaque`), left whole."""
    out = []
    for name, why in reasons.items():
        members = tuple(f"{name}.{p}" for p, _ in model.get_submodule(name).named_parameters())
        out.append(LeftOut(name, 0, members, (why,)))
    return out


def _mha_refusals(model: nn.Module, refused_calls: Mapping[str, str]) -> dict[str, str]:
    """Module name -> why its heads cannot be cut, for every ``nn.MultiheadAttention`` the shrink cannot rewrite."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.MultiheadAttention):
            continue
        why = mha_refusal(module) or refused_calls.get(name)
        if why is not None:
            out[name] = (
                f"nn.MultiheadAttention {name!r}: {why}; only batched self-attention (with at most a 2-D attn_mask, "
                "a key_padding_mask and is_causal) is computed with fewer heads, so its heads and its packed in_proj "
                "are not cut"
            )
    return out


def _multihead_attention(model: nn.Module, found: Discovery, refused_calls: Mapping[str, str]) -> Discovery:
    """Leave out, with the reason, the channels of every ``nn.MultiheadAttention`` whose heads cannot be cut."""
    reasons = _mha_refusals(model, refused_calls)
    if not reasons:
        return found
    attrs = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight")
    packed = {f"{name}.{attr}" if name else attr: name for name in reasons for attr in attrs}

    def owner(name: str) -> str | None:  # a space is named after its first writer's module
        base = name.split("#")[0]
        return base if base in reasons else None

    left, named = [], set()
    for lo in found.left_out:
        mha = owner(lo.name) or next((packed[m.split("[")[0]] for m in lo.members if m.split("[")[0] in packed), None)
        if mha is not None:
            named.add(mha)
            lo = replace(lo, reasons=(reasons[mha], *(r for r in lo.reasons if r != reasons[mha])))
        left.append(lo)
    clusters = []
    for c in found.clusters:
        hit = next((packed[m.split("[")[0]] for m in (*c.writers, *c.readers) if m.split("[")[0] in packed), None)
        if hit is not None:
            named.add(hit)
            left.append(LeftOut(c.name, c.num_units or 0, (*c.writers, *c.readers), (reasons[hit],)))
        else:
            clusters.append(c)
    for name in sorted(set(reasons) - named):  # its projections were not traced at all (kdim: separate q/k/v)
        module = model.get_submodule(name)
        members = tuple(
            p for p in packed if packed[p] == name and getattr(module, p.rsplit(".", 1)[-1], None) is not None
        )
        left.append(LeftOut(name, int(cast(int, module.num_heads)), members, (reasons[name],)))
    return Discovery(clusters=clusters, left_out=left)


def _tried(model: nn.Module, found: Discovery, example_input: Any, check: trials.Check) -> Discovery:
    """Leave out the clusters the shrink cannot rewrite, then those whose trial shrink fails."""
    if not found.clusters:
        return found
    resolved = {rc.name: rc for rc in resolve_clusters(model, found.clusters)}
    refused = trials.shrinkable(model, list(resolved.values()))
    rest = [rc for name, rc in resolved.items() if name not in refused]
    refused.update(trials.trial(model, rest, example_input, check=check))
    if not refused:
        return found
    left = list(found.left_out)
    for c in found.clusters:
        if c.name in refused:
            left.append(LeftOut(c.name, c.num_units or 0, (*c.writers, *c.readers), (refused[c.name],)))
    return Discovery(clusters=[c for c in found.clusters if c.name not in refused], left_out=left)


def _validated(model: nn.Module, found: Discovery) -> Discovery:
    """A safety net: a cluster that does not resolve against the model is left out with the error, never returned."""
    try:
        resolve_clusters(model, found.clusters)
        return found
    except ValueError:
        pass
    ok: list[Cluster] = []
    left = list(found.left_out)
    for cluster in found.clusters:  # find the culprits (quadratic, but only after a failure)
        try:
            resolve_clusters(model, [*ok, cluster])
        except ValueError as err:
            members = (*cluster.writers, *cluster.readers)
            left.append(LeftOut(cluster.name, cluster.num_units or 0, members, (f"does not resolve: {err}",)))
            continue
        ok.append(cluster)
    return Discovery(clusters=ok, left_out=left)


def prefers_discovery(model: nn.Module) -> bool:
    """Whether ``clusters="auto"`` should trace ``model`` rather than use a preset.

    True when no preset family is detected, or when only the ``linear_chain`` preset is (it sees the ``nn.Linear``
    chains of ``nn.Sequential`` containers only) while the model holds convolutions or normalization layers.
    """
    try:
        family = presets.detect(model)
    except ValueError as err:
        log.info("clusters='auto': no preset covers %s, its clusters are discovered by tracing: %s",
                 type(model).__name__, str(err).split(". Supported families")[0])  # fmt: skip
        return True
    if family != "linear_chain":
        return False
    kinds = (_ConvNd, _BatchNorm, nn.GroupNorm, nn.LayerNorm)
    return any(isinstance(m, kinds) for m in model.modules())


def discovered_clusters(
    model: nn.Module, example_input: Any, *, query_heads: bool | None = None, encoders: bool = False
) -> list[Cluster]:
    """The clusters of :func:`discover`, logging the table of what was found and left out (``clusters="auto"``).

    Args:
        model: The model to trace.
        example_input: What its ``forward`` takes.
        query_heads: As for :func:`discover` (``preset_options={"query_heads": ...}`` of ``clusters="auto"``).
        encoders: Also the encoders the trace did not reach, each traced on its own input (one-shot
            ``prune_clusters``; the callback scores from training batches, which a text run never passes through a
            multimodal LM's encoders, so it leaves them whole and logs so).

    Raises:
        ValueError: If the model cannot be traced, or no cluster is found (the table says why).
    """
    try:
        found = discover(model, example_input, query_heads=query_heads)
    except Exception as err:  # noqa: BLE001 - a trace stop (ours, or torch's own) leaves the experts, by structure
        units = [] if isinstance(err, ValueError) and not isinstance(err, TraceStop) else with_experts(model, [])
        if not (isinstance(err, ValueError) and not isinstance(err, TraceStop)):
            units = [*units, *gated_mlps(model, units)]
        if not units:
            raise
        log.warning(
            "discover: %s could not be traced (%s); only its experts' and gated MLPs' units, found by structure, are "
            "cut (%s); everything else is left whole",
            type(model).__name__, " ".join(str(err).split())[:160], ", ".join(c.name for c in units),
        )  # fmt: skip
        return units
    found = replace(found, clusters=[*found.clusters, *_encoders(model, found, query_heads=query_heads, cut=encoders)])
    config = getattr(model, "config", None)
    heads_per_layer = layer_values(config, "num_attention_heads") or []
    kv_per_layer = layer_values(config, "num_key_value_heads") or []
    pairs = list(zip(heads_per_layer, kv_per_layer, strict=False))  # per layer where the config holds them per layer
    gqa_layers = [(h, k) for h, k in pairs if isinstance(h, int) and isinstance(k, int) and 0 < k < h]
    gqa = bool(gqa_layers)
    heads, kv = gqa_layers[0] if gqa else (None, None)
    if query_heads and gqa and not any(c.unit_groups > 1 for c in found.clusters):
        log.warning(
            "discover: query_heads=True, but the heads of %s's GQA attention (%s query heads, %s KV heads) were not "
            "found as query heads, so none is cut by query heads (the heads it cuts, if any, are whole query groups); "
            "`lightning_pat.discover(model, x).table()` says what was left out and why",
            type(model).__name__, heads, kv,
        )  # fmt: skip
    experts = with_experts(model, found.clusters)
    if not experts:
        raise ValueError(
            f"discover: no prunable clusters found in {type(model).__name__}; what was left out and why:\n"
            f"{found.table()}\nDeclare the clusters by hand."
        )
    log.info("discover: %d clusters of %s:\n%s", len(found.clusters), type(model).__name__, found.table())
    return experts


def gated_mlps(model: nn.Module, taken: Sequence[Cluster] = ()) -> list[Cluster]:
    """One cluster per gated MLP found by structure, for a model whose trace stopped (BLT's entropy patcher).

    A module whose ``gate_proj`` and ``up_proj`` are ``nn.Linear`` of one output width read by its ``down_proj``
    (``down_proj(act(gate_proj(x)) * up_proj(x))``, the Llama MLP of every Hugging Face family that names it so): an
    intermediate channel is exactly removable. Modules whose parameters ``taken`` holds already (shared experts) are
    left to those clusters.
    """
    held = {m.name for rc in resolve_clusters(model, list(taken)) for m in rc.members} if taken else set()
    out = []
    for name, module in model.named_modules():
        gate, up, down = (getattr(module, p, None) for p in ("gate_proj", "up_proj", "down_proj"))
        if not all(isinstance(m, nn.Linear) for m in (gate, up, down)):
            continue
        gate, up, down = cast(nn.Linear, gate), cast(nn.Linear, up), cast(nn.Linear, down)
        if not gate.out_features == up.out_features == down.in_features or gate.out_features < 2:
            continue
        writers = [f"{name}.{p}.{k}" for p in ("gate_proj", "up_proj") for k in ("weight", "bias")
                   if getattr(getattr(module, p), k, None) is not None]  # fmt: skip
        readers = [f"{name}.down_proj.weight"]
        if held & {*writers, *readers}:
            continue
        out.append(Cluster(f"{name}.gate_proj", writers, readers))
    return out


def _encoders(model: nn.Module, found: Discovery, *, query_heads: bool | None, cut: bool) -> list[Cluster]:
    """The clusters of the encoders the trace of ``model`` did not reach, each traced on its own input.

    See :mod:`lightning_pat.discovery.encoders`: a multimodal LM's vision and audio encoders, which its text forward
    never runs. An encoder without a known example input, or one that does not trace, is left whole (logged); with
    ``cut=False`` every one is (logged).
    """
    reached = [m for c in found.clusters for m in (*c.writers, *c.readers)]
    reached += [m for lo in found.left_out for m in lo.members]
    out: list[Cluster] = []
    for path, sub, example in untraced_encoders(model, reached):
        kind = type(sub).__name__
        if not cut:
            log.warning("clusters='auto': %s %r is left whole: the training batches never pass through it, so the "
                        "callback cannot score it; prune_clusters(model, 'auto', ...) cuts it", kind, path)  # fmt: skip
            continue
        if example is None:
            log.warning("clusters='auto': %s %r is left whole: no example input is known for it (main input %r)",
                        kind, path, getattr(sub, "main_input_name", None))  # fmt: skip
            continue
        try:
            inner = discover(sub, example, query_heads=query_heads)
        except Exception as err:  # noqa: BLE001 - an encoder that does not trace is left whole, the LM still pruned
            log.warning("clusters='auto': %s %r is left whole (%s: %s)", kind, path, type(err).__name__,
                        " ".join(str(err).split())[:200])  # fmt: skip
            continue
        log.info("clusters='auto': %d clusters of %s %r, traced on its own input:\n%s", len(inner.clusters), kind,
                 path, inner.table())  # fmt: skip
        out.extend(prefixed(c, path) for c in inner.clusters)
    return out


def with_experts(model: nn.Module, clusters: Sequence[Cluster]) -> list[Cluster]:
    """``clusters`` (discovered) with the units of the model's fused routed experts and state-space mixers.

    Tracing does not see a fused-experts block's 3-D weights as channels; where the MoE preset does not cover every
    layer (an attention it does not know), its expert units (:func:`~lightning_pat.presets.moe` without heads: the
    experts' channels, whole experts, the shared experts) join the discovered clusters. Nor does it see through a
    Mamba-style mixer's scan and its own ``A_log``/``D``: the mixers' units (:func:`~lightning_pat.presets.ssm.mixers`)
    join them too. A discovered cluster sharing a parameter with the units added (the shared experts' MLP, traced as
    an ordinary one) gives way.
    """
    try:
        units = presets.moe(model, heads=False)
    except ValueError:
        units = []
    units += mixers(model)
    if not units:
        return list(clusters)
    taken = {m.name for rc in resolve_clusters(model, units) for m in rc.members}
    names = {rc.name for rc in resolve_clusters(model, units)}
    kept = []
    for c in clusters:
        resolved = resolve_clusters(model, [c])
        if any(m.name in taken for rc in resolved for m in rc.members) or any(rc.name in names for rc in resolved):
            continue
        kept.append(c)
    log.info("clusters='auto': %d expert and mixer units of %s join %d of the %d discovered clusters",
             len(units), type(model).__name__, len(kept), len(clusters))  # fmt: skip
    return [*kept, *units]


Outcome = list[Cluster] | ValueError | None  # what the callback's tracing in ``setup`` produced


def outcome_to_json(outcome: Outcome) -> dict[str, Any]:
    """Plain JSON data for a discovery outcome (clusters, the error, or nothing), so rank 0 can send it to the others.

    Example::

        >>> [c.num_units for c in outcome_from_json(outcome_to_json([Cluster("a", ["a.weight"], num_units=4)]))]
        [4]
    """
    if outcome is None:
        return {"kind": "none"}
    if isinstance(outcome, ValueError):
        return {"kind": "error", "message": str(outcome)}
    return {"kind": "clusters", "clusters": [asdict(c) for c in outcome]}


def outcome_from_json(data: Mapping[str, Any]) -> Outcome:
    """Invert :func:`outcome_to_json` (every cluster re-checked as a declaration).

    Raises:
        ValueError: If ``data`` is not what :func:`outcome_to_json` writes.
    """
    kind = data.get("kind") if isinstance(data, Mapping) else None
    if kind == "none":
        return None
    if kind == "error":
        return ValueError(str(data.get("message", "")))
    clusters = data.get("clusters") if kind == "clusters" else None
    if not isinstance(clusters, list):
        raise ValueError(
            f"discover: cannot read a discovery outcome from {data!r}; expected what outcome_to_json wrote."
        )
    return [check_declaration(c) for c in clusters]


__all__: Sequence[str] = (
    "Discovery", "LeftOut", "discover", "discovered_clusters", "outcome_from_json", "outcome_to_json",
    "prefers_discovery",
)  # fmt: skip
