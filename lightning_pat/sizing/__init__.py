"""Size targets: from "keep 90M parameters" (or FLOPs per token) to the units each cluster keeps.

A floor of its own, above ``core`` and below pruning: it reads resolved clusters and parameter shapes, never a
Trainer or a process group. :mod:`~lightning_pat.sizing.problem` says what a target means and what a configuration
counts, :mod:`~lightning_pat.sizing.solver` searches the configurations (pure, tested against brute force),
:mod:`~lightning_pat.sizing.targets` applies it to a model's clusters (per-cluster ``target`` values, unit costs by
importance) and :mod:`~lightning_pat.sizing.flops` counts FLOPs per token instead of parameters.
"""

__all__: list[str] = []  # its modules are imported by name (`from lightning_pat.sizing.<module> import ...`)
