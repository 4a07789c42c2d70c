# %% [markdown]
# # lightning_pat quickstart
#
# Percent-format notebook (open with Jupyter + jupytext, or run as a script). It declares coupled clusters on a
# tiny GPT, runs one projection by hand, then trains with `CoupledPruningCallback`.
# Set `LPAT_NOTEBOOK_STEPS` to shorten the training cell (the test suite runs it with 8 steps).

# %%
import os

import lightning.pytorch as pl
import torch

from lightning_pat import Cluster, CoupledPruningCallback, prune_clusters, resolve_clusters
from lightning_pat.demo_model import TinyGPT, TinyGPTConfig

torch.manual_seed(0)
model = TinyGPT(TinyGPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128))

# %% [markdown]
# ## Declare clusters
# One declaration with a named regex group expands into one cluster per layer. `head_dim` turns a unit into a
# block of channels: with GQA, a unit is a whole query group (its kv head and its `n_rep` query heads).

# %%
clusters = [
    Cluster(
        name="mlp.{layer}",
        writers=[r"re:(?:model\.)?layers\.(?P<layer>\d+)\.mlp\.(gate|up)_proj\.weight"],
        readers=[r"re:(?:model\.)?layers\.(?P<layer>\d+)\.mlp\.down_proj\.weight"],
    ),
    Cluster(
        name="groups.{layer}",
        head_dim=16,
        writers=[r"re:(?:model\.)?layers\.(?P<layer>\d+)\.attn\.[qkv]_proj\.weight"],
        readers=[r"re:(?:model\.)?layers\.(?P<layer>\d+)\.attn\.o_proj\.weight"],
    ),
]
for rc in resolve_clusters(model, clusters):
    blocks = {m.name.split(".")[-2]: m.block for m in rc.members}
    print(f"{rc.name:<10} C={rc.num_units:<4} channels per unit: {blocks}")

# %% [markdown]
# ## One projection by hand

# %%
result = prune_clusters(model, clusters, 0.5)
print("dropped query groups in layer 0:", result.dropped["groups.0"])
print(f"parameter sparsity of the clustered weights: {result.param_sparsity:.3f}")

# %% [markdown]
# ## Pruning-aware training


# %%
class LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT(TinyGPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        logits = self.model(x[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


steps = int(os.environ.get("LPAT_NOTEBOOK_STEPS", "60"))
tokens = torch.randint(0, 256, (64, 17), generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8)
pruning = CoupledPruningCallback(clusters, 0.5, warmup_steps=steps // 8, ramp_steps=steps // 2)
trainer = pl.Trainer(
    max_steps=steps,
    callbacks=[pruning],
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    accelerator="cpu",
)
trainer.fit(LM(), loader)
print({k: round(float(v), 3) for k, v in trainer.callback_metrics.items() if k.startswith("pruning/")})
