r"""Ready cluster declarations for common model families.

A preset reads the layout and sizes from the model (parameter names, shapes, the attention module's ``head_dim``
or ``model.config``) and returns plain :class:`~lightning_pat.Cluster` declarations. Per-layer kinds use one
regex declaration with a named ``layer`` group, so they print and serialise short. Names are matched under the
backbone's prefix as found in the module, so a preset also works on a wrapper (a LightningModule holding the model
as ``self.model``): pass the same module to the preset and to ``resolve_clusters`` / the callback.

Kinds (keyword-selectable in every transformer preset):

* ``mlp`` (on): ``mlp.{layer}``, the MLP hidden channels: gate/up rows and biases, down columns (GPT-2: ``c_fc``
  columns and bias, ``c_proj`` rows, as ``Conv1D`` stores weights ``[in, out]``).
* ``heads`` (on): ``heads.{layer}``, one unit per KV head: for MHA a head, for GQA a whole query group (its KV head
  rows in k/v, its ``n_rep`` query heads' rows in q, their o columns, q/k/v biases); HF ``repeat_kv`` and TinyGPT
  map query head ``h`` to KV head ``h // n_rep``, so a group is contiguous. GPT-2: the three chunks of the packed
  ``c_attn`` weight (columns) and bias, and ``attn.c_proj`` rows.
* ``residual`` (off): ``residual``, the hidden size across the whole model: embedding columns (and GPT-2 ``wpe``),
  every q/k/v/gate/up column, every o/down row and bias, every norm weight (and LayerNorm bias), ``lm_head``
  columns; a tied ``lm_head`` is the embedding tensor and counts once. Every parameter of the model must belong to
  the family's layout (else a ``ValueError``), because an unknown writer would keep a pruned channel alive.

Families: ``llama`` (also ``mistral``, ``qwen2``, ``qwen3``: ``*.layers.N.self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``norm``, ``embed_tokens``,
``lm_head``; Qwen3's per-head ``q_norm``/``k_norm`` act over ``head_dim`` and belong to no cluster), ``gpt2``
(``*.h.N.attn.c_attn``, ``ln_1``, ``ln_2``, ``mlp.c_fc``, ``wte``, ``wpe``, ``ln_f``) and ``linear_chain`` (see
:func:`linear_chain`), ``moe`` (fused routed experts of transformers 5, found by structure: Mixtral, Qwen2/3-MoE,
OLMoE, GraniteMoE(-shared), PhiMoE, gpt-oss, FlexOlmo, MiniMax-M2, Cohere2-MoE; expert channels, whole experts, a
shared expert, see :mod:`lightning_pat.presets.experts`). Other packages add
families with :func:`register` (the demo registers ``tiny_gpt``, its
:class:`~lightning_pat.demo.model.TinyGPT`, when ``lightning_pat.demo`` is imported).

Limitations:

* A pruned residual channel is exactly zero everywhere, but the norms still divide by the full width ``d``. RMSNorm
  over the ``d'`` kept channels reproduces the zeroed model with weight ``w * sqrt(d / d')`` and eps
  ``eps * d / d'``, so a physical shrink must rescale. LayerNorm (GPT-2) subtracts the mean over all ``d``
  channels, zeros included; no LayerNorm over ``d'`` channels reproduces that, so shrinking a GPT-2 residual is not
  output-preserving (the zeroed model is; fine-tune after the shrink).
* ``linear_chain`` cannot see ``forward``; it assumes an ``nn.Sequential`` runs its children in order.

The package: ``registry`` (the presets by name, :func:`register`, family detection, the ``clusters=`` argument),
``transformers`` (the layout model: :class:`Layout`, :func:`build`, :func:`llama`, :func:`gpt2`), ``experts``
(:func:`moe`) and ``linear_chain``.
Its names are used as ``presets.<name>`` (``from lightning_pat import presets``).
"""

from lightning_pat.presets.chains import linear_chain
from lightning_pat.presets.experts import moe
from lightning_pat.presets.registry import (
    OPTIONS,
    PRESETS,
    Preset,
    check_options,
    detect,
    for_model,
    get,
    register,
    resolve_preset,
)
from lightning_pat.presets.transformers import QUERY_HEADS_DEFAULT, Layout, build, gpt2, layer_units, llama, llama_like

__all__ = [
    "OPTIONS",
    "PRESETS",
    "QUERY_HEADS_DEFAULT",
    "Layout",
    "Preset",
    "build",
    "check_options",
    "detect",
    "for_model",
    "get",
    "gpt2",
    "layer_units",
    "linear_chain",
    "llama",
    "llama_like",
    "moe",
    "register",
    "resolve_preset",
]
