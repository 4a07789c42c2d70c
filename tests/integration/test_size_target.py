"""``target_params`` through the callback: fit a tiny Llama, shrink, and the parameter count is the reported one.

Reference: ``sum(p.numel())`` of the shrunk model (tied embedding once) and the masked model's logits.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from lightning_pat import CoupledPruningCallback, shrink
from lightning_pat.sizing.problem import parse_size
from tests.common.lit_models import ends_mid_ramp, quiet_trainer
from tests.common.tiny_families import llama_like, logits, token_ids

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

CASE = llama_like("llama", n_head=4, n_kv=2, tied=True, n_layer=4)


class LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = CASE.fresh()

    def training_step(self, batch, batch_idx):
        ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(self.global_step))
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(list(range(16)), batch_size=1)


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("target", "options", "side"),
    [("60%", {}, "below"), (0.5, {"layers": True}, "below"), (0.7, {"residual": True}, "above")],
    ids=["width", "depth+width", "residual-above"],
)
def test_fit_with_target_params_then_shrink_counts_exactly(target, options, side):
    lit = LM()
    total = count(lit.model)
    cb = CoupledPruningCallback(
        "llama", target_params=target, target_side=side, preset_options=options, warmup_steps=1, ramp_steps=2
    )
    quiet_trainer(max_steps=4, callbacks=[cb]).fit(lit)
    size = cb.size
    assert size is not None
    asked = parse_size(target, total=total)
    assert (size.total, size.target) == (total, asked)
    assert size.rule == "importance"  # target_allocation="auto" with the activation score (score="auto")
    assert cb.controller.run.solved_at == 2  # the first selection, after the warmup step
    if side == "below":
        assert size.achieved <= asked
        assert size.above is None or size.above > asked
    else:
        assert size.achieved >= asked
        assert size.below <= asked
    if options.get("layers"):
        assert size.dropped_layers >= 1
    lit.eval()
    ids = token_ids()
    ref = logits(lit.model, ids)
    small = shrink(lit, cb)
    assert count(small.model) == size.achieved
    assert float((logits(small.model, ids) - ref).abs().max() / ref.abs().max()) < 1e-5


def test_a_second_fit_keeps_the_solved_widths():
    lit = LM()
    cb = CoupledPruningCallback("llama", target_params="10k", warmup_steps=0, ramp_steps=2)
    trainer = quiet_trainer(max_steps=1, callbacks=[cb])  # stops inside the ramp
    with ends_mid_ramp():
        trainer.fit(lit)
    first = cb.size
    trainer.fit_loop.epoch_loop.max_steps = 5
    trainer.fit(lit)
    assert cb.size == first
    assert count(shrink(lit, cb).model) == first.achieved


RESUMED = {
    "layers": {"target_params": 0.5, "preset_options": {"layers": True}},
    "ranked": {"target_params": 0.6, "target_widths": "ranked", "min_kept": 0.5},
}


@pytest.mark.parametrize("kind", list(RESUMED))
def test_resume_mid_ramp_with_target_params(tmp_path, kind):
    """A run stopped inside the ramp and resumed from its checkpoint ends with the mask of an uninterrupted run."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def callback(**edit) -> CoupledPruningCallback:
        return CoupledPruningCallback("llama", **{**RESUMED[kind], **edit}, warmup_steps=1, ramp_steps=4, mode="latent")

    reference = LM()
    ref_cb = callback()
    quiet_trainer(max_steps=7, callbacks=[ref_cb]).fit(reference)

    first = LM()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    with ends_mid_ramp():
        quiet_trainer(max_steps=3, callbacks=[callback(), ckpt], checkpointing=True).fit(first)
    resumed = LM()
    cb = callback()
    quiet_trainer(max_steps=7, callbacks=[cb]).fit(resumed, ckpt_path=str(next(tmp_path.glob("*.ckpt"))))
    assert cb.dropped == ref_cb.dropped
    assert cb.size == ref_cb.size
    for (name, a), b in zip(resumed.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    if kind == "layers":
        assert any(cb.dropped[f"layer.{i}"] for i in range(CASE.n_layer))
        return
    kept = [CASE.ff - len(cb.dropped[f"mlp.{i}"]) for i in range(CASE.n_layer)]
    assert sum(kept) == cb.size.kept["mlp"]
    assert min(kept) >= CASE.ff // 2
    edited = callback(min_kept=0.25)  # another floor: the widths solved by importance at step 2 would change
    with pytest.raises(MisconfigurationException, match=r"solved by importance at step 2 .*min_kept: 0.5 -> 0.25"):
        quiet_trainer(max_steps=7, callbacks=[edited]).fit(LM(), ckpt_path=str(next(tmp_path.glob("*.ckpt"))))


def test_layer_units_refuse_shrink_on_freeze_before_any_step():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    lit = LM()
    before = {k: v.clone() for k, v in lit.state_dict().items()}
    cb = CoupledPruningCallback("llama", preset_options={"layers": True}, shrink_on_freeze=True, ramp_steps=2)
    trainer = quiet_trainer(max_steps=3, callbacks=[cb])
    with pytest.raises(MisconfigurationException, match=r"layer units .* are removed by `lightning_pat.shrink`"):
        trainer.fit(lit)
    assert trainer.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in lit.state_dict().items())


def test_fit_with_ranked_widths_shrink_export_and_reload(tmp_path):
    """target_widths='ranked': per-layer widths differ, the count is exact, and the export reloads them.

    References: ``numel`` of the shrunk model, the masked model's logits, and stock ``from_pretrained`` refusing the
    per-layer sizes (a shape mismatch error, not random weights).
    """
    from lightning_pat import load_pretrained, save_pretrained

    lit = LM()
    with torch.no_grad():
        lit.model.model.layers[2].mlp.down_proj.weight.mul_(8)  # layer 2's MLP units score highest
    total = count(lit.model)
    cb = CoupledPruningCallback(
        "llama", target_params=0.6, target_widths="ranked", min_kept=0.25, warmup_steps=1, ramp_steps=2
    )
    quiet_trainer(max_steps=4, callbacks=[cb]).fit(lit)
    size = cb.size
    assert size is not None
    assert size.achieved <= parse_size(0.6, total=total)
    assert size.above is None or size.above > parse_size(0.6, total=total)
    lit.eval()
    ids = token_ids()
    ref = logits(lit.model, ids)
    small = shrink(lit, cb)
    assert count(small.model) == size.achieved
    widths = [layer.mlp.down_proj.in_features for layer in small.model.model.layers]
    assert len(set(widths)) > 1
    assert widths[2] == max(widths)
    assert min(widths) >= CASE.ff // 4
    assert sum(widths) == size.kept["mlp"]
    assert float((logits(small.model, ids) - ref).abs().max() / ref.abs().max()) < 1e-5
    save_pretrained(small.model, tmp_path)
    again = load_pretrained(tmp_path)
    assert [layer.mlp.down_proj.in_features for layer in again.model.layers] == widths
    assert count(again) == size.achieved
    assert float((logits(again, ids) - ref).abs().max() / ref.abs().max()) < 1e-5
    with pytest.raises(RuntimeError, match="mismatch"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_fit_with_target_flops_then_shrink_counts_exactly():
    """target_flops through the callback: the shrunk model's FLOPs per token (FlopCounterMode) are the achieved."""
    from torch.utils.flop_counter import FlopCounterMode

    lit = LM()
    cb = CoupledPruningCallback("llama", target_flops="50%", seq_len=9, warmup_steps=1, ramp_steps=2)
    quiet_trainer(max_steps=4, callbacks=[cb]).fit(lit)
    size = cb.size
    assert size is not None
    assert size.unit == "FLOPs per token"
    assert size.achieved <= size.target == round(0.5 * size.total)
    small = shrink(lit, cb)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        small.model(ids)
    rotary = sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items() if name.endswith("rotary_emb"))
    assert (counter.get_total_flops() - rotary) / 9 == size.achieved
