"""The record of one module's cuts that the shrink's checks and its surgery share (:class:`Edit`).

:mod:`lightning_pat.shrink.edits` collects one :class:`Edit` per module the plan changes;
:mod:`lightning_pat.shrink.attention_checks` and :mod:`lightning_pat.shrink.optimizer_state` read them and
:mod:`lightning_pat.shrink.surgery` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn


@dataclass
class Edit:
    """The cuts of one module: attribute -> dim -> kept indices.

    Attributes:
        name: The module's name in the model.
        module: The module.
        kind: Its kind for the surgery (:func:`lightning_pat.shrink.model_meta.module_kind`).
        cuts: Attribute name -> tensor dim -> the indices kept along it.
    """

    name: str
    module: nn.Module
    kind: str
    cuts: dict[str, dict[int, Tensor]]
