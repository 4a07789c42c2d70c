"""The cut's values, owner module by owner module, for a model that is never whole on one rank.

What :func:`~lightning_pat.shrink.surgery.apply_plan` would give each cut parameter (``shrink_on_freeze`` under FSDP2).

:class:`ValueCut` is taken before the cut (it keeps a shallow copy of every module that owns a planned parameter,
so its metadata stays as it was: the width a norm is rescaled from, its eps); :meth:`ValueCut.cut` then receives the
full tensors of some planned parameters (one ``fully_shard`` group's, gathered) and returns their values after the
cut, by running ``apply_plan`` on a throwaway copy of each owner holding only those tensors: the same slicing and the
same rescaling (RMSNorm over a cut residual) as the one-device shrink, with no rule written twice. The module
metadata and the config are rewritten once for the whole model by ``apply_plan`` on a copy whose parameters are on
the meta device; only the values are computed here.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lightning_pat.shrink.plan import ShrinkPlan
from lightning_pat.shrink.surgery import apply_plan


class ValueCut:
    """The values of a plan's parameters after the cut, computed per owner module (see the module docstring).

    Args:
        model: The model the plan names, before the cut (its parameters may be DTensors or on meta: only their
            shapes and the owners' metadata are read).
        plan: The plan.

    Example::

        >>> from lightning_pat.shrink.plan import ShrinkPlan
        >>> norm = nn.RMSNorm(4, eps=1e-6)
        >>> plan = ShrinkPlan(keep={"weight": {0: torch.tensor([0, 2])}}, shapes={"weight": (4,)})
        >>> ValueCut(norm, plan).cut({"weight": torch.ones(4)})["weight"]  # rescaled by sqrt(4 / 2)
        tensor([1.4142, 1.4142])
    """

    def __init__(self, model: nn.Module, plan: ShrinkPlan) -> None:
        self.plan = plan
        owners: dict[int, tuple[nn.Module, str]] = {}
        for module in model.modules():
            for attr, param in module._parameters.items():  # noqa: SLF001 - a module's own parameters
                if param is not None:
                    owners.setdefault(id(param), (module, attr))
        params = dict(model.named_parameters(remove_duplicate=False))
        self._owner: dict[str, tuple[nn.Module, str]] = {}
        for name in plan.keep:
            module, attr = owners[id(params[name])]
            self._owner[name] = (_snapshot(module), attr)

    def cut(self, full: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The values after the cut of the planned parameters in ``full`` (name -> the whole tensor before the cut).

        Parameters of one owner should come together (a ``fully_shard`` group holds whole modules); an owner's
        parameters that are not in ``full`` stand in on the meta device.

        Raises:
            ValueError: If a name is not in the plan, or as for ``apply_plan``.
        """
        unknown = sorted(set(full) - set(self._owner))
        if unknown:
            raise ValueError(f"ValueCut.cut: {unknown[:3]} are not parameters the plan cuts; pass only planned names.")
        by_owner: dict[int, list[str]] = {}
        for name in full:
            by_owner.setdefault(id(self._owner[name][0]), []).append(name)
        out: dict[str, Tensor] = {}
        for names in by_owner.values():
            snap = self._owner[names[0]][0]
            attrs = {self._owner[n][1]: n for n in names}
            twin = copy.copy(snap)
            own = {
                attr: nn.Parameter(
                    full[attrs[attr]].detach() if attr in attrs else torch.empty(p.shape, dtype=p.dtype, device="meta"),
                    requires_grad=False,
                )
                for attr, p in snap._parameters.items()  # noqa: SLF001 - the owner's own parameters
                if p is not None
            }
            twin.__dict__["_parameters"] = own
            twin.__dict__["_buffers"] = dict(snap._buffers)  # noqa: SLF001 - cut by the metadata pass, not here
            twin.__dict__["_modules"] = {}
            if "config" in twin.__dict__:  # a config object is rewritten by the metadata pass only
                twin.__dict__["config"] = copy.deepcopy(twin.__dict__["config"])
            sub = ShrinkPlan(
                keep={a: self.plan.keep[n] for a, n in attrs.items()},
                shapes={a: self.plan.shapes[n] for a, n in attrs.items()},
            )
            apply_plan(twin, sub, check_zeros=False)
            out.update({n: getattr(twin, a).detach() for a, n in attrs.items()})
        return out


def _snapshot(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose attributes no later rewrite of ``module`` reaches."""
    snap = copy.copy(module)
    snap.__dict__["_parameters"] = dict(module._parameters)  # noqa: SLF001
    snap.__dict__["_buffers"] = dict(module._buffers)  # noqa: SLF001
    return snap
