"""Cluster discovery by tracing, for models no preset covers (no Lightning here).

``entry`` (:func:`discover`, :class:`Discovery`, the callback's ``clusters="auto"`` fallback) traces the model with
``trace`` (``torch.export`` on a meta copy) and labels channel axes with ``walk`` (label propagation over the
ATen graph).
"""

from lightning_pat.discovery.entry import (
    Discovery,
    LeftOut,
    discover,
    discovered_clusters,
    outcome_from_json,
    outcome_to_json,
    prefers_discovery,
)

__all__ = [
    "Discovery",
    "LeftOut",
    "discover",
    "discovered_clusters",
    "outcome_from_json",
    "outcome_to_json",
    "prefers_discovery",
]
