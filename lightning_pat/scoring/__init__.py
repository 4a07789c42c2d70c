"""Data-aware unit scores: statistics collected from a model's forwards and gradients.

A floor of its own, above ``core`` and ``parallel`` and below pruning: it reads resolved clusters, modules and the
pruner's executors, never a Trainer. :mod:`~lightning_pat.scoring.hooks` counts each training forward once (the base
of the hooked statistics), :mod:`~lightning_pat.scoring.activation` keeps the readers' input statistics
(``score="activation"``), :mod:`~lightning_pat.scoring.taylor` sums ``|w * g|`` over the real optimizer steps
(``score="taylor"``), :mod:`~lightning_pat.scoring.layers` scores layer units by ``1 - cos(input, output)`` and
:mod:`~lightning_pat.scoring.experts` whole routed experts by the tokens routed to them (``expert_score``). Each of the
four is a :class:`~lightning_pat.scoring.collector.Collector`: it owns its entry of the saved state and its checks.
"""

__all__: list[str] = []  # its modules are imported by name (`from lightning_pat.scoring.<module> import ...`)
