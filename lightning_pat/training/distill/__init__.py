"""Distillation from the dense model while pruning heals: a forward hook that adds the teacher's gradient.

Decision (DESIGN.md, "Distillation from a callback"): a callback cannot change the loss Lightning backpropagates,
so the distillation term enters through the student's logits. A forward hook on the module that produces them
(the LightningModule itself by default, or a named submodule) runs the teacher on the same inputs under
``no_grad`` and returns the student's logits through :class:`DistillGrad`, an autograd function that is the
identity forward and adds ``d(alpha * T^2 * KL(teacher || student)) / d logits`` to the incoming gradient
backward. So the student's gradient is the gradient of the blended loss

``user_loss + alpha * T^2 * mean_tokens KL(softmax(t / T) || softmax(s / T))``

with no change to the user's ``training_step`` and nothing wrapped (it works inside ``optimizer.step(closure)``,
under DDP, with gradient accumulation: the added gradient is divided by the accumulation factor as Lightning
divides the loss). The logged loss is the user's; the KL is logged separately (``pruning/distill_kl``, per token,
without ``alpha`` and ``T^2``). Rejected: an explicit ``loss + distill_loss(...)`` helper (asks for a code change)
and wrapping ``training_step`` (fragile).

The hook acts only inside a training batch with gradients enabled (validation and prediction forwards are
untouched). The teacher is a frozen copy of the student's logits module taken when pruning starts (after the last
warmup step, before the first selection; hooks are not copied), or a module the user passes; it is held outside the
student (not a child: not in the model's ``state_dict`` nor in any optimizer), in eval mode, with
``requires_grad=False``. Under ``ModelParallelStrategy`` the copy is sharded like the student
(:func:`~lightning_pat.parallel.teacher.sharded_frozen_copy`: each rank clones its own shards). A user's teacher is
not saved (under ``ModelParallelStrategy`` it is called as it is: sharded by the user, or a replica).

Where a copied teacher is saved (``distill_teacher_store``): ``"checkpoint"`` (default) keeps its weights in the
callback state, so every checkpoint written during pruning holds the model twice (a sharded copy as shards next to
the model's in a distributed checkpoint, gathered in a full one). ``"file"`` writes them once per directory as
safetensors at the first checkpoint save after pruning started (:mod:`lightning_pat.training.teacher_file`: per rank
for a sharded copy) and every checkpoint holds only the file's name and sha256; on resume the file is read and checked
at fit start (:meth:`Distiller.restore_file`, before the first batch), in the checkpoint's directory first. Either
store's checkpoint resumes under either setting.

Caveats: the added gradient is computed over every token (padding included); if the logits module's forward is
recomputed under activation checkpointing the teacher runs again (the gradient is still added once).

The package: :mod:`~lightning_pat.training.distill.loss` (the KL, its gradient and the autograd function; torch only),
:mod:`~lightning_pat.training.distill.teacher` (the teacher's copy, the logits in a forward output) and
:mod:`~lightning_pat.training.distill.distiller` (:class:`Distiller`: the hook, the teacher's lifecycle and its state).
"""

from lightning_pat.training.distill.distiller import Distiller
from lightning_pat.training.distill.loss import DistillGrad, kl_grad, kl_value
from lightning_pat.training.distill.teacher import (
    find_logits,
    frozen_copy,
    is_sharded_entry,
    replace_logits,
    teacher_copy,
)

__all__ = [
    "DistillGrad",
    "Distiller",
    "find_logits",
    "frozen_copy",
    "is_sharded_entry",
    "kl_grad",
    "kl_value",
    "replace_logits",
    "teacher_copy",
]
