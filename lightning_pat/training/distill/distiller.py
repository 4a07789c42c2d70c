"""The :class:`Distiller`: the hook on the student's logits module, the teacher's lifecycle, and its saved state.

See :mod:`lightning_pat.training.distill` for the design (why a hook, what the added gradient is, where a copied
teacher is saved).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_pat.parallel.comm import dtensor, ranks
from lightning_pat.parallel.teacher import has_dtensors, local_nbytes
from lightning_pat.training import state, teacher_file
from lightning_pat.training.distill.loss import DistillGrad, kl_value
from lightning_pat.training.distill.teacher import (
    find_logits,
    frozen_copy,
    is_sharded_entry,
    replace_logits,
    teacher_copy,
)
from lightning_pat.training.errors import WHO

if TYPE_CHECKING:
    from lightning_pat.pruning.options import Distillation

log = logging.getLogger(__name__)


class Distiller:
    """The teacher, the hook on the student's logits module, and the teacher's state for checkpoints.

    Args:
        alpha: Weight of the distillation term, in ``(0, 1]``.
        temperature: Softmax temperature, ``> 0``.
        teacher: A user's teacher module, or ``None`` for a frozen copy taken when pruning starts.
        error: The exception type raised on misuse (the controller passes its `forward_error`).
        store: Where a copied teacher is saved: ``"checkpoint"`` (its weights in every checkpoint) or ``"file"``
            (written once per directory, see :meth:`write_file`; checkpoints hold a reference).
    """

    def __init__(
        self,
        *,
        alpha: float,
        temperature: float,
        teacher: nn.Module | None,
        error: type[Exception] = ValueError,
        store: str = "checkpoint",
    ) -> None:
        self.alpha, self.temperature, self.user_teacher, self.error = alpha, temperature, teacher, error
        self.store = store
        self._ref: dict[str, Any] | None = None  # the file reference of the current copied teacher (store="file")
        self._written: set[str] = set()  # directories this process wrote (or found) the teacher file in
        self.teacher: nn.Module | None = teacher
        self.student: nn.Module | None = None
        self.module_name = ""
        self.scale = alpha
        self.active = False  # inside a training batch (open() ... close())
        self.on = False  # pruning has started: distill
        self.calls = 0
        self.last_kl: Tensor | None = None
        self.step = 0  # the optimizer step the open batch computes
        self._finite: list[Tensor] | None = None  # this step's [KL, student logits, teacher logits] all finite
        self._checked = False
        self._handles: list[Any] = []
        self._calls_open: list[bool] = []  # per open student call: whether another student call ran inside it
        self._saved: dict[str, Any] | None = None  # a restored teacher's weights, until the teacher is rebuilt
        self._skeleton: nn.Module | None = None  # a dense copy taken before a shrunk checkpoint loaded
        self.sharded_ckpt = False  # checkpoints are distributed checkpoints (a sharded teacher's shards go there)

    @classmethod
    def of(cls, options: Distillation, *, error: type[Exception] = ValueError) -> Distiller:
        """A distiller for the options' distillation group (its alpha, temperature, teacher and teacher store).

        Args:
            options: The checked ``distill_*`` options (``PruningOptions.distillation``).
            error: The exception type of the errors raised later (the callback's ``MisconfigurationException``).
        """
        return cls(
            alpha=options.alpha, temperature=options.temperature, teacher=options.teacher, error=error,
            store=options.teacher_store,
        )  # fmt: skip

    # ------------------------------------------------------------------ setup
    def bind(self, root: nn.Module, module_name: str, *, accumulate: int = 1, sharded_ckpt: bool = False) -> None:
        """Hook ``root.get_submodule(module_name)`` (the logits module); move a user's teacher to its device.

        ``sharded_ckpt``: checkpoints are distributed checkpoints (a sharded teacher is then written as shards
        next to the model's, see :meth:`sharded_state`).

        Raises:
            Exception: ``self.error`` if ``module_name`` names no submodule.
        """
        try:
            student = root.get_submodule(module_name)
        except AttributeError as err:
            names = [n for n, _ in root.named_modules() if n][:8]
            raise self.error(
                f"{WHO}: `distill_module={module_name!r}` names no submodule of "
                f"{type(root).__name__} (some are {names}). Name the module whose forward returns the logits, or '' "
                "for the LightningModule itself."
            ) from err
        self.release()
        self.student, self.module_name, self.scale = student, module_name, self.alpha / max(accumulate, 1)
        self.sharded_ckpt = sharded_ckpt
        if self.user_teacher is not None:
            param = next(student.parameters(), None)
            if param is not None:
                self.user_teacher.to(param.device)
            self.user_teacher.eval()
            self.user_teacher.requires_grad_(False)
        self._calls_open = []
        self._handles = [
            student.register_forward_pre_hook(self._enter),
            student.register_forward_hook(self._hook, with_kwargs=True, always_call=True),
        ]

    def open(self) -> None:
        """A training batch starts: distill its forwards (from the pruning start on)."""
        self.active, self._calls_open = True, []
        if self.calls == 0:  # a new optimizer step (not the next micro-batch of one)
            self._finite = None

    def close(self) -> Tensor | None:
        """The training batch ended: stop; return the batch's last KL (``None`` if nothing was distilled)."""
        self.active, self._calls_open = False, []
        kl, self.last_kl = self.last_kl, None
        return kl

    def check_ran(self) -> None:
        """After the backward of a training step: the logits module's forward ran (once distilling); reset the count.

        Raises:
            Exception: ``self.error`` if distillation is on and the forward of the logits module did not run.
        """
        if self.on and self.calls and self._finite is not None:
            self._check_finite()
        if self.on and self.calls == 0:
            raise self.error(
                f"{WHO}(distill_alpha={self.alpha}): the forward of `distill_module="
                f"{self.module_name!r}` did not run in this training step, so nothing was distilled. Call "
                "`self(...)` in `training_step`, or set `distill_module` to the submodule it calls (e.g. 'model')."
            )
        self.calls = 0

    def _check_finite(self) -> None:
        """Refuse a step whose distillation KL is not finite, before its update (one sync, distilled steps only).

        Raises:
            Exception: ``self.error``, naming the temperature and which logits are not finite.
        """
        assert self._finite is not None
        kl_ok, student_ok, teacher_ok = (bool(t) for t in self._finite)
        self._finite = None
        if kl_ok:
            return
        kl = None if self.last_kl is None else float(self.last_kl)
        cause = (
            "the student's logits are not finite (the model diverged before distillation could matter)"
            if not student_ok
            else "the teacher's logits are not finite"
            if not teacher_ok
            else f"the logits are finite, so the softmax at temperature {self.temperature:g} overflows or underflows"
        )
        raise self.error(
            f"{WHO}(distill_alpha={self.alpha}, distill_temperature={self.temperature:g}): the "
            f"distillation KL is not finite ({kl}) at step {self.step}: {cause}. The step was not applied (no weight "
            "changed). Use a temperature such as 1.0 or 2.0, and check the teacher (`distill_teacher`) and the loss "
            "scaling."
        )

    def release(self) -> None:
        """Remove the hook."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset(self) -> None:
        """A new schedule: forget a copied teacher and any restored state."""
        self.teacher, self._saved, self._skeleton, self.on = self.user_teacher, None, None, False
        self._ref, self._written = None, set()

    # ------------------------------------------------------------------ the teacher
    def ensure_teacher(self, *, step: int, start: int, share: tuple[Any, ...] = (), ckpt_path: Any = None) -> None:
        """Before a training batch at ``step``: build the teacher once pruning has started (``step >= start``).

        A teacher restored from a distributed checkpoint is read from ``ckpt_path`` (every rank reads its shards).

        Raises:
            Exception: ``self.error`` if pruning started before this fit and no teacher state was restored.
        """
        self.on = step >= start
        self.step = step + 1
        if self.teacher is not None or not self.on:
            return
        assert self.student is not None
        if is_sharded_entry(self._saved):  # a sharded teacher: a copy laid out like the student, then its saved shards
            # (the dense skeleton kept before a shrunk checkpoint loaded: the student is small, the teacher is not)
            teacher = self._skeleton if self._skeleton is not None else teacher_copy(self.student, share=share)
            tensors = teacher.state_dict(keep_vars=True)
            saved = state.read_latents(self._saved, tensors, ckpt_path=ckpt_path, prefix=state.TEACHER_PREFIX)
            with torch.no_grad():
                for name, tensor in tensors.items():
                    dtensor.local_tensor(tensor).copy_(saved[name])
            self.teacher, self._saved, self._skeleton = teacher, None, None
        elif self._saved is not None:
            skeleton = self._skeleton if self._skeleton is not None else frozen_copy(self.student, share=share)
            skeleton.load_state_dict(self._saved, strict=True)
            param = next(self.student.parameters(), None)
            if param is not None:  # a skeleton copied before the Trainer moved the model to its device
                skeleton.to(param.device)
            self.teacher, self._saved, self._skeleton = skeleton, None, None
        elif step == start:
            self.teacher = teacher_copy(self.student, share=share)
            self._ref, self._written = None, set()
        else:
            raise self.error(
                f"{WHO}(distill_alpha={self.alpha}): the fit continues at step {step}, after "
                f"pruning started (step {start}), but no teacher was saved (the checkpoint was written without "
                "distillation). Pass the dense model as `distill_teacher`, or resume without distillation."
            )
        ranks.rank_zero_info(
            f"{WHO}: distillation teacher ready ({self.teacher_bytes / 2**20:.1f} MiB of "
            "parameters and buffers on rank 0; logged per rank as `pruning/teacher_bytes`).",
            logger=log,
        )

    @property
    def teacher_bytes(self) -> int:
        """Bytes this rank holds for the teacher's parameters and buffers (its shards when sharded; 0 if none)."""
        return 0 if self.teacher is None else local_nbytes(self.teacher)

    def keep_skeleton(self, module: nn.Module, saved: Mapping[str, Any] | None, module_name: str) -> None:
        """Before a shrunk checkpoint loads into ``module``: keep a dense copy to rebuild the teacher into.

        The copy is taken while ``module`` still has the full-size shapes (the shrink to the checkpoint's shapes
        comes next): a frozen copy, or under FSDP2 / tensor parallel one sharded like the full-size student (each
        rank clones its own shards, no communication; the saved teacher's shards or gathered tensors load into it).
        """
        if saved and saved.get("teacher") is not None and self.user_teacher is None:
            share = (getattr(module, "_trainer", None),)
            self._skeleton = teacher_copy(module.get_submodule(module_name), share=share)

    # ------------------------------------------------------------------ the hook
    def _enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if module is self.student:
            if self._calls_open:
                self._calls_open[-1] = True
            self._calls_open.append(False)

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if module is not self.student:
            return None
        wrapper = self._calls_open.pop() if self._calls_open else False
        # A call that contains another call of the same module is a wrapper's (Lightning's forward redirection under
        # DDP routes ``training_step`` through the module's ``__call__``): only the innermost call's output is logits.
        if wrapper or not self.active or not torch.is_grad_enabled():
            return None
        logits = find_logits(output)
        if logits is None:
            raise self.error(
                f"{WHO}(distill_alpha={self.alpha}): the forward of `distill_module="
                f"{self.module_name!r}` returned {type(output).__name__}, which is neither a tensor nor has "
                "`logits`. Set `distill_module` to the submodule whose output is the logits."
            )
        if dtensor.is_dtensor(logits):  # e.g. vocabulary-sharded logits for loss_parallel: not supported
            raise self.error(
                f"{WHO}(distill_alpha={self.alpha}): the forward of `distill_module="
                f"{self.module_name!r}` returned DTensor logits (placements {tuple(logits.placements)}); distillation "
                "needs plain logits, identical on the ranks that share a batch. Give the output layer a plain output "
                "(ColwiseParallel(output_layouts=Replicate(), use_local_output=True)), without loss_parallel."
            )
        self.calls += 1
        if self.teacher is None or not (self.on or (self.user_teacher is not None and not self._checked)):
            return None  # warmup: nothing to distill yet (a user's teacher is checked on the first forward)
        with torch.no_grad():
            target = find_logits(self.teacher(*args, **kwargs))
        if target is None or target.shape != logits.shape:
            found = None if target is None else tuple(target.shape)
            raise self.error(
                f"{WHO}: `distill_teacher` must return logits of the student's shape "
                f"{tuple(logits.shape)} on the same inputs, got {found}. Pass a teacher with the student's vocabulary "
                "and output layout."
            )
        self._checked = True
        if not self.on:
            return None  # the first forward only checked a user's teacher
        self.last_kl = kl_value(logits, target, self.temperature)
        finite = [torch.isfinite(self.last_kl), torch.isfinite(logits).all(), torch.isfinite(target).all()]
        if self._finite is not None:  # several forwards in the step (accumulation): every one must be finite
            finite = [a & b for a, b in zip(self._finite, finite, strict=True)]
        self._finite = finite
        graded = DistillGrad.apply(logits, target.detach(), self.scale, self.temperature)  # type: ignore[no-untyped-call]  # torch's Function.apply is untyped
        return replace_logits(output, graded)

    # ------------------------------------------------------------------ state
    @property
    def saved(self) -> Any:
        """The restored teacher state waiting for :meth:`ensure_teacher` (``None`` if none)."""
        return self._saved

    def state_dict(self) -> dict[str, Any]:
        """A copied teacher's weights (``None`` before pruning starts or with a user's teacher).

        A sharded teacher (DTensors) is an entry of the latents' formats (:mod:`lightning_pat.training.state`):
        ``dcp`` (names only; the shards travel in the model state, :meth:`sharded_state`) or ``full`` (gathered:
        a collective, every rank calls this).
        """
        if self.teacher is None or self.teacher is self.user_teacher:
            return {"teacher": self._ref if self._ref is not None and self._saved is not None else self._saved}
        if self.store == "file":
            if self._ref is None:
                self._ref = teacher_file.reference(self.teacher.state_dict())
            return {"teacher": self._ref}
        if has_dtensors(self.teacher):
            tensors = self.teacher.state_dict()
            local = {n: dtensor.local_tensor(t) for n, t in tensors.items()}
            return {"teacher": state.latent_entry(local, tensors, fmt="dcp" if self.sharded_ckpt else "full")}
        return {"teacher": self.teacher.state_dict()}

    def sharded_state(self) -> dict[str, Tensor]:
        """For a distributed checkpoint: a sharded teacher's shards as model-state entries, else ``{}``."""
        if self.teacher is None or self.teacher is self.user_teacher or not self.sharded_ckpt or self.store == "file":
            return {}
        if not has_dtensors(self.teacher):
            return {}
        tensors = self.teacher.state_dict()
        local = {n: dtensor.local_tensor(t) for n, t in tensors.items()}
        return state.sharded_latents(local, tensors, prefix=state.TEACHER_PREFIX)

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Stash a saved teacher; it is rebuilt before the next training batch (a file: see :meth:`restore_file`)."""
        self.teacher = self.user_teacher
        teacher = saved.get("teacher") if isinstance(saved, Mapping) else saved
        if teacher is not None and not isinstance(teacher, Mapping):
            raise self.error(
                f"{WHO}: the checkpoint's distillation teacher must be a mapping, got "
                f"{type(teacher).__name__}; the checkpoint was edited or is not one of ours."
            )
        self._saved = None if teacher is None else dict(teacher)
        self._ref, self._written = None, set()

    def check_saved(self) -> None:
        """At fit start: a restored teacher (its weights, or a reference) fits its schema and the student's tensors.

        Raises:
            ValueError: If the saved teacher is not a mapping of tensors with the student's names, shapes and dtypes
                (a plain teacher), or a reference or sharded entry is malformed.
        """
        saved = self._saved
        if saved is None or self.user_teacher is not None:
            return
        if teacher_file.is_file_entry(saved):
            teacher_file.check_entry(saved, world=ranks.world_size())
            return
        if is_sharded_entry(saved):
            if saved["format"] not in ("full", "dcp"):
                raise ValueError(f"the checkpoint's distillation teacher has an unknown format {saved['format']!r}.")
            return
        assert self.student is not None
        like = (self._skeleton if self._skeleton is not None else self.student).state_dict(keep_vars=True)
        bad = [n for n, t in saved.items() if not isinstance(t, Tensor)]
        missing, extra = sorted(set(like) - set(saved)), sorted(set(saved) - set(like))
        differ = [
            n for n in sorted(set(like) & set(saved))
            if n not in bad and (tuple(saved[n].shape) != tuple(like[n].shape) or saved[n].dtype != like[n].dtype)
        ]  # fmt: skip
        if bad or missing or extra or differ:
            raise ValueError(
                f"the checkpoint's distillation teacher does not fit `distill_module={self.module_name!r}` (not "
                f"tensors {bad[:3]}, missing {missing[:3]}, unexpected {extra[:3]}, other shapes or dtypes "
                f"{differ[:3]}); resume with the model the checkpoint was written for, or pass `distill_teacher`."
            )

    def restore_file(self, *, directories: Sequence[str | os.PathLike[str]]) -> None:
        """At fit start: read and check the teacher file a restored reference names (nothing else to do otherwise).

        The file is looked up in ``directories`` in order (the checkpoint's directory first); its tensors wait in
        memory until :meth:`ensure_teacher` loads them into a fresh copy. A user's teacher needs no file.

        Raises:
            ValueError: As :func:`lightning_pat.training.teacher_file.read_teacher_file` (missing, truncated,
                modified or foreign file, a name that is not a plain teacher file name, another world size or layout).
        """
        if not teacher_file.is_file_entry(self._saved) or self.user_teacher is not None:
            return
        assert self.student is not None
        entry = dict(self._saved)
        like_module = self._skeleton if self._skeleton is not None else self.student
        tensors = teacher_file.read_teacher_file(
            entry, directories=directories, like=like_module.state_dict(keep_vars=True)
        )
        self._saved = {"format": "local", "tensors": tensors} if entry.get("sharded") else tensors
        self._ref = entry

    def write_file(self, directories: Sequence[str | os.PathLike[str]]) -> None:
        """After a checkpoint save with ``store="file"``: write the teacher file into ``directories`` once each.

        Every rank calls this (a sharded teacher: each rank writes its shards; else rank 0 writes). Nothing happens
        without a copied teacher (a restored one not rebuilt yet is written from the tensors read at fit start).
        """
        if self.store != "file" or self._ref is None:
            return
        todo = [str(d) for d in directories if str(d) not in self._written]
        if not todo:
            return
        if self.teacher is not None and self.teacher is not self.user_teacher:
            tensors: Mapping[str, Tensor] = self.teacher.state_dict()
        elif isinstance(self._saved, Mapping):
            tensors = self._saved["tensors"] if is_sharded_entry(self._saved) else self._saved
        else:
            return
        for directory in todo:
            teacher_file.write(self._ref, tensors, directory)
            self._written.add(directory)
