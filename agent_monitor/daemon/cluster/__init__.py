"""Cluster mode: replicas share runs through Redis and an MQTT 5 shared subscription, one owner
per run."""

from ._cluster import Cluster
from ._store import ClusterJournal, ClusterUnavailable

__all__ = [
    "Cluster",
    "ClusterJournal",
    "ClusterUnavailable",
]
