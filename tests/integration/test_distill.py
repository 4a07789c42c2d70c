"""Distillation from the dense model (``distill_alpha``): the gradient, the teacher, validation, resume, shrink.

The reference gradient is autograd on the blended loss written out in float64
(``mse(s, y) + alpha * T^2 * mean_tokens sum_v p_t (log p_t - log p_s)``), independent of the hook's hand-derived
backward (:func:`lightning_pat.training.distill.kl_grad`).
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_pat import CoupledPruningCallback
from lightning_pat.training.distill import Distiller
from tests.common.distill_reference import distill_term
from tests.common.lit_models import MLPModule, StepDataModule, ends_mid_ramp, mlp_cluster, quiet_trainer

pytestmark = pytest.mark.integration

SCHEDULE = {"warmup_steps": 2, "ramp_steps": 4, "every_n_steps": 1}
TOTAL = 9  # final ramp step is 6; healing after it


def blended_loss(student: nn.Module, teacher: nn.Module, x, y, *, alpha: float, temperature: float):
    """The loss whose gradient the hook must produce, written out by hand (any dtype)."""
    s, t = student(x), teacher(x)
    return nn.functional.mse_loss(s, y) + distill_term(s, t, alpha=alpha, temperature=temperature)


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize(("alpha", "temperature", "accumulate"), [(0.5, 1.0, 1), (1.0, 2.5, 1), (0.3, 0.7, 2)])
def test_hook_gradient_equals_the_blended_loss_gradient_float64(alpha, temperature, accumulate):
    student, teacher = Net(0).double(), Net(1).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)  # tokens over two leading dims: the mean is over 15 tokens
    y = torch.randn(3, 5, 4, dtype=torch.float64)
    reference = copy.deepcopy(student)  # before the hook is attached
    distiller = Distiller(alpha=alpha, temperature=temperature, teacher=teacher)
    distiller.bind(student, "", accumulate=accumulate)
    distiller.ensure_teacher(step=0, start=0)
    distiller.open()
    (nn.functional.mse_loss(student(x), y) / accumulate).backward()  # Lightning divides the loss the same way
    got = {n: p.grad.clone() for n, p in student.named_parameters()}

    ref_teacher = Net(1).double()
    (blended_loss(reference, ref_teacher, x, y, alpha=alpha, temperature=temperature) / accumulate).backward()
    for name, param in reference.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-10, atol=1e-12, msg=name)
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert distiller.last_kl is not None
    assert distiller.last_kl > 0

    distiller.close()  # outside a training batch the output is untouched
    out = student(x)
    assert out.grad_fn.name() != "DistillGradBackward"
    distiller.release()


class GradRecorder(pl.Callback):
    """Before the pruning callback: the parameters each forward used and the raw gradients of each step."""

    def __init__(self) -> None:
        self.params: dict[int, dict] = {}
        self.grads: dict[int, dict] = {}
        self.teachers: dict[int, dict] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.params[trainer.global_step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads[trainer.global_step] = {n: p.grad.clone() for n, p in pl_module.named_parameters()}


def assert_blended_gradients(module, rec, teacher, *, start: int, alpha: float, temperature: float) -> None:
    """Every recorded step's gradient against float64 autograd: the user's loss before ``start``, blended from it."""
    for step in sorted(rec.grads):
        student = StepNet().double()
        student.load_state_dict({k: v.double() for k, v in rec.params[step].items()})
        x, y = (t.double() for t in module.batch(step))
        if step < start:  # warmup: the user's loss alone
            loss = nn.functional.mse_loss(student(x), y)
        else:
            dense = StepNet().double()
            dense.load_state_dict({k: v.double() for k, v in teacher.state_dict().items()})
            loss = blended_loss(student, dense, x, y, alpha=alpha, temperature=temperature)
        loss.backward()
        for name, param in student.named_parameters():
            torch.testing.assert_close(rec.grads[step][name], param.grad.float(), rtol=1e-5, atol=1e-6)


class StepNet(StepDataModule):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.val_calls = 0

    def batch(self, step: int):
        g = torch.Generator().manual_seed(10_000 + step)
        return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)

    def validation_step(self, batch, batch_idx):
        self.val_calls += 1
        x, y = batch
        with torch.enable_grad():  # even with gradients on, a validation forward is not distilled
            out = self(x)
        assert torch.equal(out, self.forward(x))  # forward() directly bypasses every hook
        assert out.grad_fn is None or "DistillGrad" not in out.grad_fn.name()
        self.log("val_loss", nn.functional.mse_loss(out, y))

    def val_dataloader(self):
        return self.train_dataloader()


def make_cb(**overrides) -> CoupledPruningCallback:
    kwargs = {**SCHEDULE, "mode": "direct", "distill_alpha": 0.7, "distill_temperature": 2.0, **overrides}
    return CoupledPruningCallback(mlp_cluster(), 0.5, **kwargs)


def test_fit_gradient_is_the_blended_loss_gradient_with_the_frozen_dense_teacher():
    module = StepNet(lr=0.2)
    cb, rec = make_cb(), GradRecorder()
    snapshot = {}

    class AtWarmupEnd(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == SCHEDULE["warmup_steps"]:
                snapshot.update({k: v.clone() for k, v in pl_module.state_dict().items()})

    trainer = quiet_trainer(max_steps=TOTAL, callbacks=[rec, cb, AtWarmupEnd()], log_every_n_steps=1)
    trainer.fit(module)
    teacher = cb.teacher
    assert teacher is not None
    # the teacher is the model when pruning started, bitwise, never updated, not part of the model or the optimizer
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, snapshot[name]), name
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    optimized = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert not optimized & {id(p) for p in teacher.parameters()}
    assert not set(trainer.optimizers[0].state) & set(teacher.parameters())
    assert not any(mod is teacher for mod in module.modules())
    assert "pruning/distill_kl" in trainer.callback_metrics
    # the teacher's memory is a logged metric: this rank's bytes of its parameters and buffers (here the whole model)
    assert float(trainer.callback_metrics["pruning/teacher_bytes"]) == sum(
        t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers())
    )

    assert_blended_gradients(module, rec, teacher, start=SCHEDULE["warmup_steps"], alpha=0.7, temperature=2.0)
    # the distillation term mattered: the blended gradient differs from the user's alone after the ramp started
    step = TOTAL - 1
    student = StepNet()
    student.load_state_dict(rec.params[step])
    nn.functional.mse_loss(student(module.batch(step)[0]), module.batch(step)[1]).backward()
    assert not torch.allclose(student.fc1.weight.grad, rec.grads[step]["fc1.weight"], atol=1e-6)


class CountingTeacher(MLPModule):
    def __init__(self, seed: int) -> None:
        super().__init__(seed=seed)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def test_one_teacher_forward_per_training_step_and_validation_untouched():
    module = StepNet(lr=0.2)
    teacher = CountingTeacher(seed=5)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    cb = make_cb(distill_teacher=teacher)
    trainer = quiet_trainer(
        max_steps=TOTAL, callbacks=[cb], val_check_interval=3, num_sanity_val_steps=2, limit_val_batches=2
    )
    trainer.fit(module)
    assert module.val_calls > 0
    # one forward at the first batch (the shape check) and one per step from pruning start; none in validation
    assert teacher.calls == 1 + TOTAL - SCHEDULE["warmup_steps"]
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in teacher.parameters())


STOPS = {"warmup": 2, "ramp": 4, "final": 6, "healing": 8}


@pytest.mark.parametrize("shrink", [False, True], ids=["masked", "shrink_on_freeze"])
def test_resume_equals_uninterrupted_bitwise_with_the_teacher_restored(tmp_path, shrink):
    def trainer_for(cb, *, every=0):
        callbacks = [cb]
        if every:
            callbacks.append(
                pl.callbacks.ModelCheckpoint(
                    dirpath=tmp_path, filename="{step}", every_n_train_steps=every, save_top_k=-1
                )
            )
        return quiet_trainer(max_steps=TOTAL, callbacks=callbacks, checkpointing=bool(every))

    module = StepNet(lr=0.2, optimizer="adamw")
    cb = make_cb(shrink_on_freeze=shrink, mode="latent")
    trainer_for(cb, every=1).fit(module)
    want = {k: v.clone() for k, v in module.state_dict().items()}
    want_teacher = {k: v.clone() for k, v in cb.teacher.state_dict().items()}
    if shrink:  # the student was shrunk, the teacher kept the dense shape
        assert module.fc1.weight.shape[0] == 16
        assert cb.teacher.fc1.weight.shape[0] == 32
    for where, k in STOPS.items():
        resumed = StepNet(lr=0.2, optimizer="adamw", seed=99)
        cb2 = make_cb(shrink_on_freeze=shrink, mode="latent")
        trainer_for(cb2).fit(resumed, ckpt_path=str(tmp_path / f"step={k}.ckpt"))
        got = resumed.state_dict()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (where, name)
        for name, tensor in cb2.teacher.state_dict().items():
            assert torch.equal(tensor, want_teacher[name]), (where, name)


def test_the_checkpoint_holds_the_teacher_only_in_the_callback_state(tmp_path):
    module = StepNet(lr=0.2)
    trainer = quiet_trainer(max_steps=4, callbacks=[make_cb()], checkpointing=True, default_root_dir=tmp_path)
    with ends_mid_ramp():
        trainer.fit(module)
    path = tmp_path / "ckpt.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert set(ckpt["state_dict"]) == set(module.state_dict())
    (state,) = (v for k, v in ckpt["callbacks"].items() if k.startswith("CoupledPruningCallback"))
    assert set(state["distill"]["teacher"]) == set(module.state_dict())


def test_a_fresh_trainer_takes_a_new_teacher_and_a_resume_without_one_is_refused(tmp_path):
    module = StepNet(lr=0.2)
    cb = make_cb()
    with ends_mid_ramp():
        quiet_trainer(max_steps=4, callbacks=[cb]).fit(module)
    first = cb.teacher
    with ends_mid_ramp():
        quiet_trainer(max_steps=4, callbacks=[cb]).fit(module)  # a new schedule: a new copy at its warmup end
    assert cb.teacher is not first
    assert not torch.equal(cb.teacher.fc1.weight, first.fc1.weight)

    plain = CoupledPruningCallback(mlp_cluster(), 0.5, **SCHEDULE, mode="direct")
    trainer = quiet_trainer(max_steps=4, callbacks=[plain], checkpointing=True, default_root_dir=tmp_path)
    with ends_mid_ramp():
        trainer.fit(StepNet(lr=0.2))
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(MisconfigurationException, match=r"no teacher was saved .* Pass the dense model as"):
        quiet_trainer(max_steps=6, callbacks=[make_cb()]).fit(StepNet(lr=0.2), ckpt_path=str(tmp_path / "plain.ckpt"))


class DirectCallModule(StepNet):
    def training_step(self, batch, batch_idx):
        x, y = self.batch(self.global_step)
        return nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def test_a_training_step_that_bypasses_the_logits_module_is_refused():
    with pytest.raises(MisconfigurationException, match=r"`distill_module=''` did not run in this training step"):
        quiet_trainer(max_steps=TOTAL, callbacks=[make_cb()]).fit(DirectCallModule(lr=0.2))


def test_distill_module_selects_a_submodule_and_hf_style_outputs():
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLPModule()

        def forward(self, x):
            return {"logits": self.net(x)}

    class Outer(StepNet):
        def __init__(self) -> None:
            super().__init__(lr=0.2)
            self.model = Wrapped()

        def training_step(self, batch, batch_idx):
            x, y = self.batch(self.global_step)
            return nn.functional.mse_loss(self.model(x)["logits"], y)

    module = Outer()
    cb = CoupledPruningCallback(
        [{"name": "hidden", "writers": ["model.net.fc1.weight"], "readers": ["model.net.fc2.weight"]}],
        0.5, **SCHEDULE, distill_alpha=0.5, distill_module="model",
    )  # fmt: skip
    quiet_trainer(max_steps=TOTAL, callbacks=[cb]).fit(module)
    assert isinstance(cb.teacher, Wrapped)
    assert cb.teacher is not module.model


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_ddp_two_ranks_gradient_is_the_average_blended_gradient():
    import json
    from pathlib import Path

    from tests.common.dist import run_rank_scripts

    outputs = run_rank_scripts(Path(__file__).parent / "workers" / "distill_worker.py", 2, args=[], timeout=200)
    results = [json.loads(line[7:]) for out in outputs for line in out.splitlines() if line.startswith("RESULT ")]
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["checked"] == 5  # steps 2..6 distil (warmup 1)
        assert r["max_diff"] < 1e-6
        assert r["teacher_disagreements"] == 0
        assert not r["teacher_in_optimizer"]
        assert r["teacher_grads"] == 0


class HFStep(pl.LightningModule):
    """A tiny Hugging Face llama whose batch is a function of the step; ``training_step`` reads ``.logits``."""

    CONFIG = {
        "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 2, "attn_implementation": "eager",
    }  # fmt: skip

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(LlamaConfig(**self.CONFIG))

    @staticmethod
    def ids(step: int) -> torch.Tensor:
        return torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(500 + step))

    def training_step(self, batch, batch_idx):
        ids = self.ids(self.global_step)
        logits = self.model(input_ids=ids[:, :-1]).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 1)), batch_size=1)


def test_hf_model_output_logits_with_keyword_inputs_get_the_blended_gradient():
    module, teacher = HFStep(seed=0), HFStep(seed=1).model
    rec = GradRecorder()
    cb = CoupledPruningCallback(
        "llama", 0.5, warmup_steps=0, ramp_steps=3, mode="direct", distill_alpha=0.8, distill_temperature=1.5,
        distill_teacher=teacher, distill_module="model",
    )  # fmt: skip
    quiet_trainer(max_steps=3, callbacks=[rec, cb]).fit(module)
    for step in range(3):
        student, dense = HFStep().model.double(), HFStep(seed=1).model.double()
        student.load_state_dict({k[len("model.") :]: v.double() for k, v in rec.params[step].items()})
        ids = HFStep.ids(step)
        s = student(input_ids=ids[:, :-1]).logits
        t = dense(input_ids=ids[:, :-1]).logits
        ce = nn.functional.cross_entropy(s.flatten(0, 1), ids[:, 1:].flatten())
        (ce + distill_term(s, t, alpha=0.8, temperature=1.5)).backward()
        for name, param in student.named_parameters():
            torch.testing.assert_close(rec.grads[step]["model." + name], param.grad.float(), rtol=1e-4, atol=1e-6)


def test_teacher_forwards_do_not_reach_the_students_activation_statistics():
    counts = {}

    class Peek(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            act = trainer.callbacks[0].controller.run.collectors.act
            if act is not None:
                counts[trainer.global_step] = act.state_dict()["count"]

    cb = make_cb(score="activation")
    with ends_mid_ramp():
        quiet_trainer(max_steps=5, callbacks=[cb, Peek()]).fit(StepNet(lr=0.2))
    assert cb.teacher is not None
    # one student forward per step: the teacher (a copy without hooks) adds nothing
    assert counts == {step: {"fc2": step} for step in range(1, 6)}


def test_frozen_copy_has_no_hooks_and_shares_what_it_is_told_to():
    from lightning_pat.training.distill import frozen_copy

    net, seen, shared = Net(0), [], object()
    net.fc1.register_forward_pre_hook(lambda mod, args: seen.append(mod))
    net.owner = shared
    copy_ = frozen_copy(net, share=(shared,))
    copy_(torch.randn(2, 8))
    assert seen == []  # the student's hooks stayed with the student
    assert copy_.owner is shared
    assert not copy_.training
    assert not any(p.requires_grad for p in copy_.parameters())
    net(torch.randn(2, 8))
    assert seen == [net.fc1]


def test_fsdp1_is_refused_at_setup_and_model_parallel_is_accepted():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    cb = make_cb()
    with pytest.raises(
        MisconfigurationException,
        match=r"distill_alpha=0.7\) supports a single device, DDP and ModelParallelStrategy .*got FSDPStrategy: "
        r"FSDP1's flat parameters .*Use ModelParallelStrategy with fully_shard",
    ):
        cb.setup(SimpleNamespace(strategy=FSDPStrategy()), StepNet(), "fit")
    cb.setup(SimpleNamespace(strategy=ModelParallelStrategy()), StepNet(), "fit")  # FSDP2 / TP: supported
