"""Pruning during training: the controller, its state, and the Lightning callback.

The Lightning-free ``controller`` with its state schema (``state``), latent copies (``latent``), scorers
(``collectors``), distillation (``distill``) and metrics (``metrics``); the Lightning ``callback`` on top (imported
lazily by ``lightning_pat``), with its read-only ``views`` and what it reads from a Trainer (``trainer_facts``).
"""

__all__: list[str] = []  # its modules are imported by name (`from lightning_pat.training.<module> import ...`)
