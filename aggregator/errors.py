"""The aggregator's exceptions: one root, :class:`AggregatorError` (the module that defines
each class on the right)::

    AggregatorError
     +-- SnapshotError          a round-machine snapshot that cannot be restored
     |                          (malformed, another policy or aggregator key)   (rounds)
     +-- SiteSnapshotError      a site's snapshot that cannot be restored
     |                          (malformed, another site, key or gateways)      (site)
     +-- CheckpointCorrupted    the checkpoint file is missing, truncated or fails its
                                checksum                                        (store)

Input from a peer that the aggregator rejects raises edge_sdk's protocol errors
(:class:`edge_sdk.errors.RemoteProtocolError` and its subclasses, whose tree
:mod:`edge_sdk.errors` draws): the aggregator shares the device's wire and protocol code,
and the round machine turns them into a rejection, never a crash. Bad configuration files
raise :class:`edge_sdk.config.ConfigError`. ``tests/test_exported_members.py`` checks that
every public exception class of the aggregator is in this tree and drawn here.
"""

from __future__ import annotations

__all__ = ["AggregatorError"]


class AggregatorError(Exception):
    """Root of the aggregator's errors (see the module docstring's tree)."""
