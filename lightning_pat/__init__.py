"""lightning_pat: pruning-aware training for PyTorch Lightning (coupled structured pruning that shrinks)."""

from lightning_pat.__about__ import __version__
from lightning_pat.callback import CoupledPruningCallback
from lightning_pat.engine import Pruner, PruneResult, prune_clusters
from lightning_pat.spec import Cluster, ResolvedCluster, resolve_clusters

__all__ = [
    "Cluster",
    "CoupledPruningCallback",
    "PruneResult",
    "Pruner",
    "ResolvedCluster",
    "__version__",
    "prune_clusters",
    "resolve_clusters",
]
