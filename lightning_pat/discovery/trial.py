"""Discovery returns only clusters the shrink turns into a model that runs and equals the masked model.

Two checks after the walk, for :func:`~lightning_pat.discovery.entry.discover`:

1. **The shrink can rewrite every member** (:func:`shrinkable`): each cluster goes through the shrink's own
   validation (:func:`~lightning_pat.shrink.check_shrinkable`), so a parameter used by a module the shrink cannot
   rewrite (``F.linear(x, self.w)``, an unsupported ``nn.MultiheadAttention``'s ``in_proj_weight``, an embedding's
   vocabulary rows) is left out with the shrink's message instead of being pruned for a whole run and refused at the
   end.
2. **A trial shrink** (:func:`trial`): a copy of the model drops one unit of every cluster and is shrunk; with
   ``check="values"`` the copy has random weights (its buffers are the model's), the masked copy's outputs on the
   example input are compared with the shrunk copy's (:mod:`lightning_pat.shrink.verify`); with ``check="meta"`` the
   copy is a meta copy and only has to run. This catches what tracing cannot see: a channel count in a module
   attribute or a literal (``view(B, T, 4, d)``, ``split(x, self.sizes)``, a head count derived from the input width
   as in a hand-written Swin, ``x.split(self.chs // 2)``). If the joint trial fails, halves are tried (group testing),
   so each failing cluster is left out with the error of its own trial.

``check="auto"`` compares values for models of at most ``VALUE_TRIAL_MAX`` parameters (the random copy is allocated on
the CPU) and runs a meta copy above that.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from lightning_pat.core.spec import ResolvedCluster
from lightning_pat.shrink import apply_plan, build_plan, check_shrinkable, verify

log = logging.getLogger(__name__)

Check = Literal["auto", "values", "meta", "none"]
#: ``check="auto"`` compares values up to this many parameters (fp32 on the CPU: 1 GiB)
VALUE_TRIAL_MAX = 1 << 28


def shrinkable(model: nn.Module, clusters: Sequence[ResolvedCluster]) -> dict[str, str]:
    """Cluster name -> the shrink's refusal, for every cluster the shrink could not rewrite."""
    refused = {}
    for rc in clusters:
        try:
            check_shrinkable(model, [rc])
        except ValueError as err:
            refused[rc.name] = f"the shrink cannot rewrite it: {err}"
    return refused


def _random_copy(model: nn.Module, seed: int) -> nn.Module:
    """A CPU copy of ``model`` in fp32 with random parameters (fan-in scaled; norm weights near 1) and its buffers."""
    gen = torch.Generator().manual_seed(seed)
    norms = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)  # noqa: SLF001
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, norms) and m.weight is not None}
    memo: dict[int, Any] = {}
    for p in model.parameters():
        shape = tuple(p.shape)
        if not p.is_floating_point():
            value = torch.zeros(shape, dtype=p.dtype)
        elif len(shape) >= 2:
            fan_in = max(1, int(torch.tensor(shape[1:]).prod()))
            value = torch.randn(shape, generator=gen) / fan_in**0.5
        elif id(p) in norm_weights:
            value = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            value = 0.1 * torch.randn(shape, generator=gen)
        memo[id(p)] = nn.Parameter(value, p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("cpu", torch.float32 if b.is_floating_point() else b.dtype, copy=True)
    for module in model.modules():
        for attr in ("_trainer", "_fabric", "_device_mesh", "_strategy"):
            if module.__dict__.get(attr) is not None:
                memo[id(module.__dict__[attr])] = None
    return copy.deepcopy(model, memo)


def _zero_dropped(model: nn.Module, plan: Any) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, dims in plan.keep.items():
            param = params[name]
            for dim, kept in dims.items():
                mask = torch.ones(param.shape[dim], dtype=torch.bool)
                mask[kept] = False
                param.index_fill_(dim, mask.nonzero().flatten(), 0.0)


def _one_per_group(rc: ResolvedCluster) -> list[int]:
    """The last unit of each of the cluster's ``unit_groups``; none where a group has a single unit.

    Query heads: one per KV group, as a selection keeps the groups balanced.
    """
    groups = max(1, getattr(rc, "unit_groups", 1))
    per = rc.num_units // groups
    return [] if per < 2 else [(g + 1) * per - 1 for g in range(groups)]


class _Trial:
    """Trial shrinks of subsets of the clusters on copies of one model."""

    def __init__(self, model: nn.Module, example_input: Any, mode: Literal["values", "meta"]) -> None:
        self.model, self.mode = model, mode
        self.example = verify.move(example_input, torch.device("cpu"), torch.float32 if mode == "values" else None)
        self.count = 0

    def fails(self, clusters: Sequence[ResolvedCluster]) -> str | None:
        """Why shrinking ``clusters`` (one unit dropped in each) breaks the model, or ``None``."""
        self.count += 1
        plan = build_plan(clusters, {rc.name: _one_per_group(rc) for rc in clusters if rc.num_units > 1})
        if self.mode == "meta":
            twin = verify.meta_copy(self.model)
            try:
                apply_plan(twin, plan, check_zeros=False, record=False)
            except ValueError as err:  # the shrink's validation refuses the cut (a module between writer and reader)
                return str(err)
            failed = verify.runs_on_meta(twin, self.example)
            return None if failed is None else f"the shrunk model does not run: {failed[1]}"
        twin = _random_copy(self.model, seed=self.count)
        _zero_dropped(twin, plan)
        before = verify.record(twin, self.example)
        if not all(bool(t.isfinite().all()) for t in before.outputs if t.is_floating_point()):
            return None  # random weights overflowed: no evidence either way (the shrink's own check decides)
        try:
            apply_plan(twin, plan, check_zeros=False, record=False)
        except ValueError as err:  # the shrink's validation refuses the cut (a module between writer and reader)
            return str(err)
        try:
            verify.compare(twin, self.example, before)
        except verify.ShrinkCheckError as err:
            return str(err)
        return None

    def culprits(self, clusters: Sequence[ResolvedCluster]) -> dict[str, str]:
        """Cluster name -> why, for the clusters whose trial shrink fails (group testing by halves)."""
        reason = self.fails(clusters)
        if reason is None:
            return {}
        if len(clusters) == 1:
            return {clusters[0].name: f"a trial shrink (one unit dropped) fails: {reason}"}
        half = len(clusters) // 2
        found = {**self.culprits(clusters[:half]), **self.culprits(clusters[half:])}
        if not found:  # each half shrinks, together they do not
            found = {rc.name: f"shrunk together with the clusters {[c.name for c in clusters][:6]}: {reason}"
                     for rc in clusters}  # fmt: skip
        return found


def trial(model: nn.Module, clusters: Sequence[ResolvedCluster], example_input: Any, *, check: Check) -> dict[str, str]:
    """Cluster name -> why, for every cluster whose trial shrink fails (see the module docstring).

    Raises:
        ValueError: If the example input does not fit the (unshrunk) model with ``check="values"``.
    """
    if check == "none" or not clusters:
        return {}
    mode: Literal["values", "meta"]
    if check == "auto":
        mode = "values" if sum(p.numel() for p in model.parameters()) <= VALUE_TRIAL_MAX else "meta"
    else:
        mode = check
    runner = _Trial(model, example_input, mode)
    if mode == "meta" and verify.runs_on_meta(verify.meta_copy(model), runner.example) is not None:
        log.info("discover: %s does not run on meta tensors; no trial shrink", type(model).__name__)
        return {}
    found = runner.culprits(list(clusters))
    log.info("discover: %d trial shrinks (%s) of %d clusters", runner.count, mode, len(clusters))
    return found
