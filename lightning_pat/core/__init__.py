"""The ground floor: pure torch math, no communication, no Trainer.

Declarations and their resolution (``spec``), the step schedule, unit <-> channel arithmetic (``units``), unit
scores, deterministic selection and masking.
"""
