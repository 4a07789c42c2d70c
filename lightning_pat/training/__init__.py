"""Pruning during training: the controller, its state, and the Lightning callback.

The Lightning-free ``controller`` with its state schema (``state``), latent copies (``latent``) and metrics
(``metrics``), and the Lightning ``callback`` on top (imported lazily by ``lightning_pat``).
"""
