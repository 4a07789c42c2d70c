r"""Cluster declarations, pattern expansion, validation and resolved clusters.

A :class:`Cluster` is plain data (YAML-friendly). :func:`resolve_clusters` expands it against a module's named
parameters into :class:`ResolvedCluster` objects, validating every member before anything is mutated.

The package, one job per module:

* ``declaration``: :class:`Cluster` and its static checks (:func:`check_declaration`, :func:`as_cluster`,
  :func:`found_clusters`);
* ``resolved``: :class:`Member`, :class:`ResolvedCluster`, their plain-type form (``to_dict``/``from_dict``) and
  fingerprint;
* ``patterns``: member patterns (exact names, globs, ``re:`` regexes, channel-axis slices) matched against parameter
  names, and :data:`WRAPPER_NAMES`;
* ``resolve``: :func:`resolve_clusters` and :func:`ensure_resolved`, the resolution against a module's tensors.

Its names are imported from the package (``from lightning_pat.core.spec import Cluster``).
"""

from lightning_pat.core.spec.declaration import Cluster, as_cluster, check_declaration, found_clusters
from lightning_pat.core.spec.patterns import WRAPPER_NAMES, Entry, GroupKey, SliceSpec
from lightning_pat.core.spec.resolve import ensure_resolved, resolve_clusters
from lightning_pat.core.spec.resolved import Member, ResolvedCluster, Role

__all__ = [
    "WRAPPER_NAMES",
    "Cluster",
    "Entry",
    "GroupKey",
    "Member",
    "ResolvedCluster",
    "Role",
    "SliceSpec",
    "as_cluster",
    "check_declaration",
    "ensure_resolved",
    "found_clusters",
    "resolve_clusters",
]
