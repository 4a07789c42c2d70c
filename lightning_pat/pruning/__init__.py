"""The pruning floor's one step, without a Trainer: options, declarations, plan, pruner and the one-shot API.

``options`` (``PruningOptions`` and ``StepOptions``, each checked once where it enters), ``declarations``
(``clusters=`` into declarations: presets, discovery), ``plan`` (:func:`~lightning_pat.pruning.plan.make_plan`:
resolved, routed, sized), ``pruner`` (:class:`~lightning_pat.pruning.pruner.Pruner`), ``api``
(:func:`~lightning_pat.prune_clusters`) and ``allocation`` (:func:`~lightning_pat.size_clusters`). The public names
are re-exported by ``lightning_pat``.
"""

__all__: list[str] = []  # its modules are imported by name (`from lightning_pat.pruning.<module> import ...`)
