"""The dense latent copies of latent mode: swap in before the update, commit after it, restore on resume.

In latent mode the optimizer updates a dense copy of every pruned parameter while the model trains its
projection. :class:`LatentStore` owns those copies (rank-local pieces, so a DTensor's latent is its local shard)
for the ramp only; it knows nothing about Lightning, schedules or checkpoints beyond its own ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor

from lightning_pat.parallel.comm import dtensor


def _copy_all(dst: Sequence[Tensor], src: Sequence[Tensor]) -> None:
    """``d.copy_(s)`` for every pair, as one batched ``_foreach_copy_`` (same values, fewer kernel launches)."""
    if dst:
        torch._foreach_copy_(list(dst), list(src))


class LatentStore:
    """Latent copies of ``names`` (rank-local pieces), created on the first :meth:`commit`.

    Args:
        params: Parameter name -> live parameter (plain tensor or DTensor).
        names: The parameters that get a latent copy.
    """

    def __init__(self, params: Mapping[str, Tensor], names: Sequence[str]) -> None:
        self.params = params
        self.names = list(names)
        self._latents: dict[str, Tensor] = {}
        self._swapped: set[str] = set()

    @property
    def active(self) -> bool:
        """Whether latent copies exist."""
        return bool(self._latents)

    @property
    def swapped(self) -> bool:
        """Whether some latent is in the weights right now (between :meth:`swap_in` and :meth:`commit`)."""
        return bool(self._swapped)

    def swap_in(self, optimizer_params: Collection[int]) -> None:
        """Copy the latents of parameters the optimizer updates (by ``id``) into the weights, before the update."""
        names = [n for n in self._latents if id(self.params[n]) in optimizer_params]
        _copy_all([dtensor.local_tensor(self.params[n]) for n in names], [self._latents[n] for n in names])
        self._swapped.update(names)

    def commit(self) -> None:
        """After the update: keep the updated weights as latents, and put every other latent back into its weight.

        The first call creates the latents from the current weights.
        """
        if not self._latents:
            self._latents = {n: dtensor.local_tensor(self.params[n]).clone() for n in self.names}
        kept = [n for n in self._latents if n in self._swapped]
        back = [n for n in self._latents if n not in self._swapped]
        _copy_all([self._latents[n] for n in kept], [dtensor.local_tensor(self.params[n]) for n in kept])
        _copy_all([dtensor.local_tensor(self.params[n]) for n in back], [self._latents[n] for n in back])
        self._swapped.clear()

    def clear(self) -> None:
        """Free the latents (the mask is frozen)."""
        self._latents.clear()
        self._swapped.clear()

    def state_dict(self) -> dict[str, Tensor]:
        """Name -> rank-local latent (the live tensors; clone before mutating)."""
        return dict(self._latents)

    def load_state_dict(self, latents: Mapping[str, Tensor]) -> None:
        """Set the latents from rank-local tensors (copied).

        Raises:
            ValueError: If names or local shapes do not match the parameters.
        """
        missing = sorted(set(self.names) - set(latents))
        if missing:
            raise ValueError(f"The saved latent copies lack parameters {missing[:5]}; resume with the same model.")
        out = {}
        for name in self.names:
            local = dtensor.local_tensor(self.params[name])
            saved = latents[name]
            if tuple(saved.shape) != tuple(local.shape):
                raise ValueError(
                    f"The saved latent of {name!r} has shape {tuple(saved.shape)}, the parameter's local piece "
                    f"{tuple(local.shape)}; resume with the same model and the same parallel layout."
                )
            out[name] = saved.to(device=local.device, dtype=local.dtype).clone()
        self._latents = out
        self._swapped.clear()
