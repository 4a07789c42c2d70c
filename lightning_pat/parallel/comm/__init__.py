"""Communication: the only modules that call ``torch.distributed`` collectives, one job each.

* ``dtensor``: DTensor queries, rank-local views and write-backs;
* ``reduce``: float partials summed in a fixed rank order, exact integer counts, the mesh groups they span;
* ``ranks``: the world, rank-zero messages, agreement (``together``: a ``ValueError`` on one rank stops every rank),
  object collectives;
* ``fsdp2``: FSDP2 introspection and the teacher's packed gather;
* ``dcp``: distributed checkpoint I/O.
"""

__all__: list[str] = []  # its modules are imported by name (`from lightning_pat.parallel.comm import ranks`)
