"""The dense latent copies of latent mode: swap in before the update, commit after it, restore on resume.

In latent mode the optimizer updates a dense copy of every pruned parameter while the model trains its
projection. :class:`LatentStore` owns those copies (rank-local pieces, so a DTensor's latent is its local shard)
for the ramp only; it knows nothing about Lightning, schedules or checkpoints beyond its own ``state_dict``.
:func:`check_entry` checks a saved state's ``latents`` entry (its formats are
:mod:`lightning_pat.training.state`'s) against the parameters' :class:`TensorFacts` before a resume applies it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pat.core.state_fields import FieldChecker, describe
from lightning_pat.core.state_schema import LATENT_FORMATS
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


# ---------------------------------------------------------------------------------------------------- the saved entry
@dataclass(frozen=True)
class TensorFacts:
    """What a saved tensor must match: the parameter's global shape, this rank's local shape, its dtype."""

    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype


def check_entry(
    raw: object, what: str, *, facts: Mapping[str, TensorFacts] | None = None, world: int = 1, rank: int = 0
) -> None:
    """Check a saved state's ``latents`` entry (``None``: none saved) before anything of the state is applied.

    Args:
        raw: The entry.
        what: The state's name, the first words of every message.
        facts: Parameter name -> facts, for every parameter that gets a latent copy (``None``: the names, shapes and
            dtypes are not checked).
        world: The number of ranks (a ``per_rank`` entry holds one entry per rank).
        rank: This rank (its ``per_rank`` piece is checked against ``facts``).

    Raises:
        StateError: Naming the field, what was expected and what was found.
    """
    check = FieldChecker(what)
    entry = check.mapping(raw, "latents", allow_none=True)
    if entry is None:
        return
    fmt = entry.get("format")
    if fmt not in LATENT_FORMATS:
        raise check.fail("latents.format", f"must be one of {LATENT_FORMATS}, got {describe(fmt)}")
    if fmt == "dcp":
        names = check.sequence(entry.get("names"), "latents.names")
        if not all(isinstance(n, str) for n in names):
            raise check.fail("latents.names", "must be a list of parameter names")
        _same_names(check, names, facts, "latents.names")
        return
    if fmt == "per_rank":
        pieces = check.sequence(entry.get("tensors"), "latents.tensors")
        if len(pieces) != world:
            raise check.fail(
                "latents.tensors",
                f"holds the latent pieces of {len(pieces)} rank(s) (FSDP1 flat shards), and this run has {world}",
                f"resume on {len(pieces)} ranks, or from a checkpoint written outside the ramp",
            )
        for r, piece in enumerate(pieces):
            _tensors(check, piece, facts if r == rank else None, f"latents.tensors[{r}]", local=True)
        return
    _tensors(check, entry.get("tensors"), facts, "latents.tensors", local=fmt != "full")


def _tensors(
    check: FieldChecker, raw: object, expected: Mapping[str, TensorFacts] | None, where: str, *, local: bool
) -> None:
    tensors = check.mapping(raw, where)
    assert tensors is not None
    for name, value in tensors.items():
        facts = None if expected is None else expected.get(name)
        tensor = check.tensor(value, f"{where}[{name!r}]", scan=False)  # a model-sized copy: not scanned
        if facts is None:
            continue
        want = facts.local_shape if local else facts.shape
        if tuple(tensor.shape) != tuple(want):
            raise check.fail(f"{where}[{name!r}]", f"has shape {tuple(tensor.shape)}, the parameter {tuple(want)}")
        if tensor.dtype != facts.dtype:
            raise check.fail(f"{where}[{name!r}]", f"has dtype {tensor.dtype}, the parameter {facts.dtype}")
    _same_names(check, list(tensors), expected, where)


def _same_names(check: FieldChecker, names: Sequence[str], expected: Mapping[str, Any] | None, where: str) -> None:
    if expected is None:
        return
    missing, extra = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
    if missing or extra:
        raise check.fail(
            where,
            f"names other parameters than the clustered ones (missing {missing[:5]}, unexpected {extra[:5]})",
            "resume with the model and clusters the checkpoint was written for",
        )
