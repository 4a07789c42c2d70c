"""Layouts and communication: collectives, DTensor layouts, FSDP1, executors.

Every collective (``comm``, one module per job), DTensor layout arithmetic (``placement``), FSDP1 compatibility
(``fsdp1``) and the ``executors`` that score and mask clusters per layout (materializing or sharded) and the routing
between them.
"""

__all__: list[str] = []  # its modules are imported by name (`from lightning_pat.parallel.<module> import ...`)
