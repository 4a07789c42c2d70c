"""The callback ranks whole routed experts by their training tokens (``expert_score``), against a reference.

A tiny Mixtral (4 experts, top-2) trains a few Trainer steps under :class:`~lightning_pat.CoupledPruningCallback`.
Test-side forward pre-hooks record what each MoE block received in every training forward, with the router's and the
experts' weights of that moment; the reference scores are computed from those, from the definition: the router's
softmax over the experts still in the router (a dropped expert's router row is zero, so it is removed from the
softmax, as in the shrunk model), top-2, renormalised weights ``g``, the expert's SwiGLU output ``f``, and per expert
``sum g * ||f||`` (``reap_sum``), its mean (``reap``) or the count (``frequency``) over the steps since the previous
selection. The experts the callback drops are the lowest of the reference, and the scores it used match. A resume in
the middle of the statistics continues bitwise; a checkpoint without the entry (older) resumes; a dense model's state
is unchanged.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_pat import CoupledPruningCallback
from tests.common.lit_models import MLPModule, mlp_cluster, quiet_trainer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.integration

VOCAB, EXPERTS, LAYERS, TOP_K = 64, 4, 2, 2


def tiny_mixtral() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, vocab_size=VOCAB, attn_implementation="eager",
        tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


class Step(pl.LightningModule):
    """The tiny Mixtral; the batch is a function of the step (so a resumed run sees the same tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_mixtral()

    def training_step(self, batch, batch_idx):
        x = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(100 + self.global_step))
        logits = self.model(input_ids=x[:, :-1]).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(16, 1)), batch_size=1)


class Record(pl.Callback):
    """Per training forward and layer: the block's input and weights; per step: the callback's mask and scores."""

    def __init__(self, pruning: CoupledPruningCallback) -> None:
        self.pruning = pruning
        self.calls: list[tuple[int, int, tuple[torch.Tensor, ...]]] = []  # (step, layer, (h, router, gate_up, down))
        self.dropped: dict[int, dict[str, list[int]]] = {}
        self.used: dict[int, dict[str, torch.Tensor]] = {}
        self._handles: list = []

    def on_fit_start(self, trainer, module):
        for i, layer in enumerate(module.model.model.layers):
            self._handles.append(layer.mlp.register_forward_pre_hook(self._hook(trainer, i)))

    def _hook(self, trainer, i):
        def hook(block, args):
            if torch.is_grad_enabled():
                weights = (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
                self.calls.append((trainer.global_step + 1, i, tuple(t.detach().clone() for t in (args[0], *weights))))

        return hook

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        self.dropped[step] = {k: list(v) for k, v in self.pruning.dropped.items()}
        experts = self.pruning.controller.scorers.experts
        if experts is not None and experts.last:
            self.used[step] = dict(experts.last)
            experts.last = {}

    def on_fit_end(self, trainer, module):
        for handle in self._handles:
            handle.remove()


def reference(calls, steps: range, kind: str) -> dict[str, torch.Tensor]:
    """Per layer ``experts.{i}``: the scores over the training forwards of ``steps``, from the definition."""
    sums = {i: torch.zeros(EXPERTS, dtype=torch.float64) for i in range(LAYERS)}
    counts = {i: torch.zeros(EXPERTS, dtype=torch.float64) for i in range(LAYERS)}
    for step, i, (h, router, gate_up, down) in calls:
        if step not in steps:
            continue
        x = h.reshape(-1, h.shape[-1]).double()
        kept = (router != 0).any(dim=1)  # a dropped expert's router row is zero: it is not in the router
        logits = (x @ router.double().T)[:, kept]
        probs = torch.softmax(logits, dim=-1)
        top, where = probs.topk(TOP_K, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        experts = kept.nonzero().flatten()[where]  # [T, K] expert ids
        for t in range(x.shape[0]):
            for k in range(TOP_K):
                e = int(experts[t, k])
                gate, up = (gate_up[e].double() @ x[t]).chunk(2)
                out = down[e].double() @ (nn.functional.silu(gate) * up)
                sums[i][e] += top[t, k] * out.norm()
                counts[i][e] += 1
    if kind == "frequency":
        return {f"experts.{i}": counts[i] for i in range(LAYERS)}
    if kind == "reap_sum":
        return {f"experts.{i}": sums[i] for i in range(LAYERS)}
    return {f"experts.{i}": sums[i] / counts[i].clamp(min=1) for i in range(LAYERS)}


def fit(kind: str, tmp_path=None, *, max_steps: int = 4, ckpt: str | None = None, every: int = 0):
    module = Step()
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=3, expert_score=kind, score="rms")
    record = Record(cb)
    callbacks: list = [cb, record]
    if every:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1))
    quiet_trainer(max_steps=max_steps, callbacks=callbacks, checkpointing=bool(every)).fit(module, ckpt_path=ckpt)
    return module, cb, record


@pytest.mark.parametrize("kind", ["reap_sum", "reap", "frequency"])
def test_dropped_experts_are_the_lowest_of_the_reference_over_the_steps_since_the_last_selection(kind):
    _, cb, record = fit(kind)
    selections = sorted(record.used)  # the selections of the ramp (steps 2, 3, 4)
    assert selections == [2, 3, 4]
    previous = 0
    for step in selections:
        want = reference(record.calls, range(previous + 1, step + 1), kind)
        for name, scores in want.items():
            torch.testing.assert_close(record.used[step][name], scores, rtol=1e-5, atol=1e-9)
            dropped = record.dropped[step][name]
            lowest = torch.argsort(scores, stable=True)[: len(dropped)]
            assert sorted(dropped) == sorted(lowest.tolist()), (step, name, scores)
        previous = step
    assert all(len(cb.dropped[f"experts.{i}"]) == EXPERTS // 2 for i in range(LAYERS))
    # a dropped expert gets no token in later steps: the masked router routes around it
    first = record.dropped[2]
    later = reference(record.calls, range(3, 5), "frequency")
    for name, units in first.items():
        if name.startswith("experts."):
            assert all(later[name][u] == 0 for u in units)


def _state(path) -> dict:
    checkpoint = torch.load(path, weights_only=False)
    return next(v for k, v in checkpoint["callbacks"].items() if "CoupledPruningCallback" in k)


def test_resume_in_the_middle_of_the_statistics_is_bitwise(tmp_path):
    straight, cb, first = fit("reap_sum", tmp_path / "a", max_steps=4, every=1)
    mid = _state(tmp_path / "a" / "epoch=0-step=1.ckpt")  # warmup: one step of statistics, no selection yet
    assert sum(mid["expert_scores"][0]["count"]["experts.0"]) == 2 * 8 * TOP_K  # every token's top-2 slots
    assert mid["options"]["expert_score"] == "reap_sum"
    ckpt = str(tmp_path / "a" / "epoch=0-step=1.ckpt")
    resumed, cb2, record = fit("reap_sum", tmp_path / "b", max_steps=4, ckpt=ckpt, every=1)
    assert cb2.dropped == cb.dropped
    for step in (2, 3, 4):  # the scores of every selection are the same bits (step 2's: the restored step 1's sums)
        assert record.used[step].keys() == first.used[step].keys()
        assert all(torch.equal(record.used[step][n], first.used[step][n]) for n in first.used[step]), step
        name = f"epoch=0-step={step}.ckpt"
        assert _state(tmp_path / "a" / name)["dropped"] == _state(tmp_path / "b" / name)["dropped"]
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_a_checkpoint_without_the_entry_resumes_and_collects_from_there(tmp_path):
    fit("reap_sum", tmp_path / "a", max_steps=4, every=1)
    path = tmp_path / "a" / "epoch=0-step=1.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    state = next(v for k, v in checkpoint["callbacks"].items() if "CoupledPruningCallback" in k)
    del state["expert_scores"], state["options"]["expert_score"]  # as written before the expert scores existed
    torch.save(checkpoint, tmp_path / "old.ckpt")
    _, cb, record = fit("reap_sum", max_steps=4, ckpt=str(tmp_path / "old.ckpt"))
    want = reference(record.calls, range(2, 3), "reap_sum")  # the statistics start at the resumed step
    for name, scores in want.items():
        torch.testing.assert_close(record.used[2][name], scores, rtol=1e-5, atol=1e-9)
    assert all(len(v) == EXPERTS // 2 for k, v in cb.dropped.items() if k.startswith("experts."))


def test_a_dense_model_saves_what_it_saved_before():
    cb = CoupledPruningCallback(mlp_cluster(), 0.5, warmup_steps=1, ramp_steps=1)
    quiet_trainer(max_steps=2, callbacks=[cb]).fit(MLPModule())
    state = cb.controller.state_dict()
    assert "expert_scores" not in state
    assert "expert_score" not in state["options"]
    assert cb.controller.scorers.experts is None


def test_an_unknown_expert_score_is_refused_with_the_choices():
    with pytest.raises(Exception, match=r"`expert_score` must be one of \('reap_sum', 'reap', 'frequency', 'weight'\)"):
        CoupledPruningCallback("auto", 0.5, expert_score="mean")


def test_experts_that_get_no_top_k_are_ranked_by_their_weights_without_a_warning():
    """Llama 4's experts module runs every expert on pre-scaled tokens: no routing to read, the weights rank."""
    from tests.common.lm_zoo import build  # noqa: PLC0415 - only this test

    class Llama4Step(Step):
        def __init__(self) -> None:
            pl.LightningModule.__init__(self)
            self.model = build("llama4_text")

    module = Llama4Step()
    weighted = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2, expert_score="weight")
    quiet_trainer(max_steps=3, callbacks=[weighted]).fit(module)
    module = Llama4Step()
    cb = CoupledPruningCallback("auto", 0.5, warmup_steps=1, ramp_steps=2)  # the default, a data score
    quiet_trainer(max_steps=3, callbacks=[cb]).fit(module)  # a PruningWarning would fail the test
    assert cb.controller.scorers.experts is not None
    assert cb.dropped == weighted.dropped
