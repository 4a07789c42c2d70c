"""lightning_pat: pruning-aware training for PyTorch Lightning (coupled structured pruning that shrinks)."""

from typing import TYPE_CHECKING, Any

from lightning_pat import presets
from lightning_pat.__about__ import __version__
from lightning_pat.core.pruning_warning import PruningWarning
from lightning_pat.core.spec import Cluster, ResolvedCluster, resolve_clusters
from lightning_pat.discovery import discover
from lightning_pat.export import load_pretrained, save_pretrained
from lightning_pat.pruning.allocation import SizedClusters, size_clusters
from lightning_pat.pruning.api import prune_clusters
from lightning_pat.pruning.pruner import Pruner, PruneResult

if TYPE_CHECKING:
    from lightning_pat.shrink.entry import shrink
    from lightning_pat.training.callback import CoupledPruningCallback
    from lightning_pat.training.recipes import OneShotPruningCallback
else:
    # the package itself, callable as shrink(model, source): the public name hides none of its modules
    from lightning_pat import shrink

__all__ = [
    "Cluster",
    "CoupledPruningCallback",
    "OneShotPruningCallback",
    "PruneResult",
    "Pruner",
    "PruningWarning",
    "ResolvedCluster",
    "SizedClusters",
    "__version__",
    "discover",
    "load_pretrained",
    "presets",
    "prune_clusters",
    "resolve_clusters",
    "save_pretrained",
    "shrink",
    "size_clusters",
]


def __getattr__(name: str) -> Any:
    """Import the callback (and Lightning) only when it is used: the engine alone stays light."""
    if name == "CoupledPruningCallback":
        from lightning_pat.training.callback import CoupledPruningCallback

        return CoupledPruningCallback
    if name == "OneShotPruningCallback":
        from lightning_pat.training.recipes import OneShotPruningCallback

        return OneShotPruningCallback
    raise AttributeError(f"module 'lightning_pat' has no attribute {name!r}")
