"""``shrink_on_freeze`` glue of the callback: shrink the model at the freeze, and resume a run shrunk that way.

After the shrink the callback heals the small model and only counts steps. A checkpoint written after the shrink
holds the small shapes, so a fresh module is given them by a ``load_state_dict`` pre-hook (installed at ``setup``,
removed at fit start) before the checkpoint's weights load. No Lightning here: errors come from ``_validation``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from lightning_pat import _validation as V
from lightning_pat.shrink import restore_shrunk, shrink_for_training
from lightning_pat.spec import ResolvedCluster


def _shape_mismatches(module: nn.Module, weights: Mapping[str, Any]) -> dict[str, tuple[tuple, tuple]]:
    """Name -> (the module's shape, the checkpoint's shape) of every tensor whose shapes differ."""
    out = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        other = weights.get(name)
        if other is not None and hasattr(other, "shape") and tuple(other.shape) != tuple(tensor.shape):
            out[name] = (tuple(tensor.shape), tuple(other.shape))
    return out


class ShrinkOnFreeze:
    """Whether and how the model was shrunk, and the pre-hook that resumes a shrunk run.

    Attributes:
        dropped: Cluster name -> dropped unit indices once the model has been shrunk, else ``None``.
        resolved: The clusters the model was shrunk by (set together with ``dropped``).
    """

    def __init__(self) -> None:
        self.dropped: dict[str, list[int]] | None = None
        self.resolved: list[ResolvedCluster] = []
        self._hook: Any = None

    def watch(self, module: nn.Module, *, checkpoint: Callable[[], Mapping[str, Any] | None], state_key: str) -> None:
        """Until :meth:`unwatch`, shrink ``module`` to a shrunk checkpoint's shapes before its weights load.

        Args:
            module: The LightningModule whose weights a checkpoint may restore.
            checkpoint: Returns the checkpoint being loaded (``None`` or empty when there is none).
            state_key: The callback's key in the checkpoint's ``callbacks``.
        """
        self.unwatch()  # one hook at a time (setup runs for every fit, validate, test and predict)
        self._hook = module.register_load_state_dict_pre_hook(
            lambda mod, sd, prefix, *_: self._before_restore(mod, checkpoint() or {}, sd, prefix, state_key)
        )

    def unwatch(self) -> None:
        """Remove the pre-hook (the checkpoint's weights are loaded by fit start)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _before_restore(
        self, module: nn.Module, checkpoint: Mapping[str, Any], weights: Mapping[str, Any], prefix: str, state_key: str
    ) -> None:
        if prefix:
            return
        differ = _shape_mismatches(module, weights)
        if not differ:
            return
        state = checkpoint.get("callbacks", {}).get(state_key)
        if state and state.get("shrunk"):  # a checkpoint written after the shrink: give the module its shapes
            with V.user_error("CoupledPruningCallback: cannot resume the shrunk model"):
                restore_shrunk(module, state)
            if self.dropped is None:
                self.resolved = [ResolvedCluster.from_dict(rc) for rc in state["clusters"]]
                self.dropped = {k: list(v) for k, v in state["dropped"].items()}
            return
        if self.dropped is not None:  # this module was shrunk; the checkpoint holds the full-size weights
            name, (mine, theirs) = next(iter(differ.items()))
            with V.user_error("CoupledPruningCallback(shrink_on_freeze=True)"):
                raise ValueError(
                    f"the checkpoint predates the shrink: it holds the full-size weights ({name!r} of shape {theirs}), "
                    f"but this module was shrunk at the final ramp step ({name!r} is now {mine}; "
                    f"{len(differ)} tensor(s) differ). Evaluate that checkpoint on a fresh, full-size module "
                    "(`trainer.validate(MyModule(), ckpt_path=...)`), pass a checkpoint written after the shrink, or "
                    "omit `ckpt_path` to use the shrunk module's current weights."
                )

    def shrink(
        self,
        module: nn.Module,
        resolved: list[ResolvedCluster],
        dropped: dict[str, list[int]],
        *,
        optimizers: Sequence[Any],
    ) -> None:
        """Cut the frozen mask's units out of ``module`` and the optimizers' state.

        Raises:
            MisconfigurationException: If the module cannot be shrunk in place.
        """
        with V.user_error("CoupledPruningCallback(shrink_on_freeze=True)"):
            shrink_for_training(module, resolved, dropped, optimizers=optimizers)
        self.resolved, self.dropped = resolved, dropped
