"""Distiller.of builds the distiller from the options' distillation group, as the keywords do."""

from __future__ import annotations

from torch import nn

from lightning_pat.pruning.options import PruningOptions
from lightning_pat.training.distill.distiller import Distiller


def test_of_takes_the_distillation_group_as_the_keywords_do():
    teacher = nn.Linear(3, 3)
    opts = PruningOptions(
        clusters="linear_chain", distill_alpha=0.25, distill_temperature=2, distill_teacher=teacher,
        distill_teacher_store="file",
    )  # fmt: skip
    grouped = Distiller.of(opts.distillation, error=KeyError)
    keywords = Distiller(alpha=0.25, temperature=2.0, teacher=teacher, error=KeyError, store="file")
    for d in (grouped, keywords):
        assert (d.alpha, d.temperature, d.store, d.error, d.scale) == (0.25, 2.0, "file", KeyError, 0.25)
        assert d.user_teacher is teacher
        assert d.teacher is teacher
    assert Distiller.of(PruningOptions(clusters="linear_chain", distill_alpha=0.5).distillation).error is ValueError
