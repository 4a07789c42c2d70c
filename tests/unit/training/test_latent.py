"""``training/latent.py``: the latent copies' saved entry is checked by its owner, against the parameters' facts.

The edits of a real state's ``latents`` entry are refused through a resume in tests/unit/core/test_state_schema.py;
here the layouts a one-process run never writes (``per_rank``, ``dcp``) are checked directly.
"""

from __future__ import annotations

import pytest
import torch

from lightning_pat.core.state_fields import StateError
from lightning_pat.training.latent import TensorFacts, check_entry

FACTS = {"w": TensorFacts(shape=(8, 4), local_shape=(4, 4), dtype=torch.float32)}


def test_every_layout_is_checked_against_the_parameters():
    check_entry(None, "s")  # none saved
    check_entry({"format": "tensors", "tensors": {"w": torch.zeros(4, 4)}}, "s", facts=FACTS)  # a local piece
    check_entry({"format": "full", "tensors": {"w": torch.zeros(8, 4)}}, "s", facts=FACTS)  # gathered whole
    check_entry({"format": "dcp", "names": ["w"]}, "s", facts=FACTS)
    pieces = [{"w": torch.zeros(1)}, {"w": torch.zeros(4, 4)}]  # only this rank's piece is measured
    check_entry({"format": "per_rank", "tensors": pieces}, "s", facts=FACTS, world=2, rank=1)
    check_entry({"format": "full", "tensors": {"v": torch.zeros(2)}}, "s")  # no facts: layout only


@pytest.mark.parametrize(
    ("entry", "kw", "match"),
    [
        ({"format": "pickle"}, {}, r"`latents.format` must be one of \('local', 'tensors', 'per_rank', 'full'"),
        ({"format": "full", "tensors": {"w": torch.zeros(4, 4)}}, {}, r"`latents.tensors\['w'\]` has shape \(4, 4\), "
         r"the parameter \(8, 4\)"),
        ({"format": "tensors", "tensors": {"w": torch.zeros(4, 4).double()}}, {},
         r"`latents.tensors\[.w.\]` has dtype torch.float64"),
        ({"format": "dcp", "names": ["v"]}, {}, r"`latents.names` names other parameters than the clustered ones "
         r"\(missing \['w'\], unexpected \['v'\]\); resume with the model and clusters"),
        ({"format": "per_rank", "tensors": [{}]}, {"world": 2}, r"`latents.tensors` holds the latent pieces of 1 "
         r"rank\(s\) \(FSDP1 flat shards\), and this run has 2; resume on 1 ranks"),
        ({"format": "per_rank", "tensors": [{"w": torch.zeros(4)}]}, {}, r"`latents.tensors\[0\]\['w'\]` has shape"),
    ],
)  # fmt: skip
def test_a_bad_entry_is_refused_naming_the_field(entry, kw, match):
    with pytest.raises(StateError, match=f"^s: {match}"):
        check_entry(entry, "s", facts=FACTS, **kw)
