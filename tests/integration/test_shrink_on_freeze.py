"""``shrink_on_freeze``: the model is shrunk at the final ramp step and training continues on the small model.

Reference: the same run without ``shrink_on_freeze`` (the masked model, its full-size optimizer state), with kept
indices recomputed here from the dropped units.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from lightning_pat import CoupledPruningCallback, shrink
from lightning_pat.demo.model import TinyGPT, TinyGPTConfig
from tests.common.lit_models import quiet_trainer

pytestmark = pytest.mark.integration

WARMUP, RAMP = 1, 3
FINAL = WARMUP + RAMP


class LM(pl.LightningModule):
    """TinyGPT whose batch is a function of ``global_step`` only (a resumed run sees the same data)."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        cfg = TinyGPTConfig(vocab_size=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64, max_seq_len=16)
        self.model = TinyGPT(cfg)
        self.optimizer_name = optimizer
        self.losses: list[float] = []

    @staticmethod
    def batch(step: int) -> torch.Tensor:
        return torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(100 + step))

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    def training_step(self, batch, batch_idx):
        loss = self.loss(self.batch(self.global_step))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self):
        return DataLoader(list(range(64)), batch_size=1)


class Probe(pl.Callback):
    """After the pruning callback, at the final ramp step: the loss on a fixed batch and the optimizer state."""

    def __init__(self, cb: CoupledPruningCallback) -> None:
        self.cb = cb
        self.loss: float | None = None
        self.width: int | None = None
        self.state: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.cb.step != FINAL:
            return
        with torch.no_grad():
            self.loss = pl_module.loss(LM.batch(999)).item()
        param = pl_module.model.layers[0].mlp.gate_proj.weight
        self.width = param.shape[0]
        self.state = {k: v.clone() for k, v in trainer.optimizers[0].state[param].items()}


def fit(module, cb, *, max_steps, ckpt_path=None, save_to=None):
    probe = Probe(cb)
    trainer = quiet_trainer(max_steps=max_steps, callbacks=[cb, probe])
    trainer.fit(module, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return trainer, probe


def callback(shrink_on_freeze: bool, mode: str = "latent") -> CoupledPruningCallback:
    return CoupledPruningCallback(
        "tiny_gpt",
        0.5,
        warmup_steps=WARMUP,
        ramp_steps=RAMP,
        mode=mode,
        shrink_on_freeze=shrink_on_freeze,
        log_metrics=False,
    )


def kept(dropped: list[int], *, units: int, block: int) -> list[int]:
    return [c for u in range(units) if u not in set(dropped) for c in range(u * block, (u + 1) * block)]


@pytest.mark.parametrize(("optimizer", "mode"), [("adamw", "latent"), ("sgd", "latent"), ("adamw", "direct")])
def test_shrink_on_freeze_continues_exactly_like_the_masked_run(optimizer, mode):
    small, masked = LM(optimizer), LM(optimizer)
    cb_small, cb_masked = callback(True, mode), callback(False, mode)
    trainer, probe_small = fit(small, cb_small, max_steps=FINAL + 4)
    _, probe_masked = fit(masked, cb_masked, max_steps=FINAL + 4)

    # the loss right after the shrink equals the masked model's on the same batch, and every later step too
    assert (probe_small.width, probe_masked.width) == (32, 64)  # shrunk by the time the step's hooks end
    assert probe_small.loss is not None
    assert probe_small.state
    assert probe_small.loss == pytest.approx(probe_masked.loss, rel=1e-5)
    torch.testing.assert_close(torch.tensor(small.losses), torch.tensor(masked.losses), rtol=1e-4, atol=1e-5)

    # the model really is smaller, and equals the masked model with the dropped units cut out
    assert cb_small.dropped == cb_masked.dropped
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in masked.parameters())
    reference = shrink(copy.deepcopy(masked), cb_masked)
    for (name, p), (_, q) in zip(small.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    # what a user copies after fit: the model is already small, so shrink returns it as it is (no error)
    before = {n: p.detach().clone() for n, p in small.named_parameters()}
    assert shrink(small.model, cb_small) is small.model
    assert shrink(small, cb_small) is small
    assert all(torch.equal(p, before[n]) for n, p in small.named_parameters())

    # optimizer state at the shrink: the masked run's state at the kept rows (independent index arithmetic)
    rows = kept(cb_masked.dropped["mlp.0"], units=64, block=1)
    assert probe_small.state.keys() == probe_masked.state.keys()
    for key, value in probe_masked.state.items():
        if value.dim() == 0:  # Adam's step counter is kept
            assert torch.equal(probe_small.state[key], value)
        else:
            torch.testing.assert_close(probe_small.state[key], value[rows], rtol=0, atol=0)
    assert trainer.optimizers[0].param_groups[0]["params"][0] is next(small.parameters())


def test_a_checkpoint_written_after_the_shrink_resumes(tmp_path):
    straight = LM()
    fit(straight, callback(True), max_steps=FINAL + 5)

    first = LM()
    cb_first = callback(True)
    fit(first, cb_first, max_steps=FINAL + 2, save_to=tmp_path / "shrunk.ckpt")
    ckpt = torch.load(tmp_path / "shrunk.ckpt", weights_only=False)
    [state] = [v for k, v in ckpt["callbacks"].items() if k.startswith("CoupledPruningCallback")]
    assert state["shrunk"] is True
    assert state["dropped"] == cb_first.dropped

    resumed = LM()  # full size: the callback shrinks it before the checkpoint's weights and optimizer state load
    cb = callback(True)
    trainer, _ = fit(resumed, cb, max_steps=FINAL + 5, ckpt_path=tmp_path / "shrunk.ckpt")
    assert cb.step == FINAL + 5
    assert resumed.losses == pytest.approx(straight.losses[FINAL + 2 :], rel=1e-6)
    for (name, p), (_, q) in zip(resumed.named_parameters(), straight.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    assert trainer.optimizers[0].state[resumed.model.layers[0].mlp.up_proj.weight]["exp_avg"].shape == (32, 32)

    # the same checkpoint shrinks a fresh full-size model offline (what `lightning-pat shrink` needs)
    offline = LM()
    from lightning_pat.shrink import restore_shrunk

    assert restore_shrunk(offline, ckpt)
    offline.load_state_dict(ckpt["state_dict"])
    torch.testing.assert_close(offline.loss(LM.batch(7)), first.loss(LM.batch(7)))


def test_shrink_on_freeze_refuses_ddp_and_no_healing():
    with pytest.raises(MisconfigurationException, match="needs `heal=True`"):
        CoupledPruningCallback("tiny_gpt", 0.5, heal=False, shrink_on_freeze=True)
    cb = callback(True)
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=1, logger=False)
    with pytest.raises(MisconfigurationException, match="or under ModelParallelStrategy .*got DDPStrategy"):
        cb.setup(trainer, LM(), "fit")


def test_a_cluster_the_shrink_cannot_rewrite_is_refused_at_fit_start():
    from lightning_pat import Cluster

    module = LM()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    partial = Cluster(  # q rows and o columns one channel at a time: not whole heads
        "q", writers=["model.layers.0.attn.q_proj.weight"], readers=["model.layers.0.attn.o_proj.weight"]
    )
    cb = CoupledPruningCallback([partial], 0.5, warmup_steps=WARMUP, ramp_steps=RAMP, shrink_on_freeze=True)
    with pytest.raises(MisconfigurationException, match=r"shrink_on_freeze=True.*not whole heads"):
        fit(module, cb, max_steps=FINAL + 1)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
