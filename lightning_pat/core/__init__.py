"""The ground floor: pure torch math, no communication, no Trainer.

Declarations and their resolution (``spec``), the step schedule, unit <-> channel arithmetic (``units``), unit
scores, deterministic selection and masking.
"""

__all__: list[str] = []  # its modules are imported by name (`from lightning_pat.core.<module> import ...`)
