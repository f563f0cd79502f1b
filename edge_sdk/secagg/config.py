"""The public parameters of one secure-aggregation round, the same on every party.

:class:`RoundConfig` fixes the cohort, the ring, the vector length and the SecAgg+
neighbourhood; its :meth:`~RoundConfig.digest` (SHA-256 of
``b"fedge/secagg/v1/config" + msgpack(to_wire())``) binds every signature and derived key
to the round. The encoding carries :data:`PROTOCOL_VERSION`, so the digest binds the version.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgpack

from edge_sdk._validate import check_bytes as _check_bytes
from edge_sdk._validate import check_device_id as _check_id
from edge_sdk._validate import check_int as _check_int
from edge_sdk.errors import RemoteProtocolError
from edge_sdk.hazmat.graph import (
    default_degree,
    default_threshold,
    neighbour_graph,
    neighbourhood_problem,
)
from edge_sdk.wire.messages import RoundPlan
from edge_sdk.wire.schema import PROTOCOL_VERSION

__all__ = ["RoundConfig"]

_CONFIG_LABEL = b"fedge/secagg/v1/config"
_MAX_COHORT = 1 << 16
_MAX_LENGTH = 1 << 31
_CONFIG_KEYS = frozenset({"v", "kind", "round", "nonce", "cohort", "bits", "length", "degree",
                          "threshold", "amortized"})


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundConfig:
    """Public parameters of one secure-aggregation round, the same on every party.

    Attributes:
        round_id: unique per fleet, never reused, in [0, 2^63).
        nonce: 32 public random bytes from the aggregator; seeds the neighbour graph and
            (through :meth:`digest`) binds every signature and key to this round.
        cohort: the selected devices, sorted, distinct, at least 3.
        bits: ring size exponent b, 1 <= b <= 64 (sums are mod 2^b).
        length: number of values summed (d, or k kept values in a sparse round).
        degree: neighbours per device k (n - 1 = complete graph, original SecAgg);
            otherwise even, 2 <= k < n - 1.
        threshold: Shamir t per neighbourhood, k/2 < t <= k (2t > k, see
            ``hazmat.graph.default_threshold``). Each neighbourhood tolerates k - t dropouts.
        amortized: True for the amortized zCDP-paper variant.
    """

    round_id: int
    nonce: bytes
    cohort: tuple[str, ...]
    bits: int
    length: int
    degree: int
    threshold: int
    amortized: bool = False

    def __post_init__(self) -> None:
        _check_int("round_id", self.round_id, 0, (1 << 63) - 1)
        _check_bytes("nonce", self.nonce, 32)
        if not isinstance(self.cohort, tuple):
            raise ValueError(f"cohort must be a tuple, got {type(self.cohort).__name__}")
        for dev in self.cohort:
            _check_id("cohort member", dev)
        n = len(self.cohort)
        if not 3 <= n <= _MAX_COHORT:
            raise ValueError(f"cohort must have 3 to {_MAX_COHORT} devices, got {n}")
        if list(self.cohort) != sorted(set(self.cohort)):
            raise ValueError("cohort must be sorted and distinct (sort it: order is public)")
        _check_int("bits", self.bits, 1, 64)
        _check_int("length", self.length, 1, _MAX_LENGTH)
        k = _check_int("degree", self.degree, 2, n - 1)
        _check_int("threshold", self.threshold, 1, k)
        problem = neighbourhood_problem(n, k, self.threshold)
        if problem:
            raise ValueError(problem)
        if not isinstance(self.amortized, bool):
            raise ValueError(f"amortized must be a bool, got {self.amortized!r}")

    @classmethod
    def for_cohort(
        cls,
        *,
        round_id: int,
        nonce: bytes,
        cohort: Iterable[str],
        bits: int,
        length: int,
        degree: int | None = None,
        threshold: int | None = None,
        full_graph: bool = False,
        amortized: bool = False,
    ) -> RoundConfig:
        """A config with the cohort sorted and SecAgg+ defaults for degree and threshold."""
        members = tuple(sorted(cohort))
        n = len(members)
        if full_graph:
            k = n - 1
        elif degree is None:
            k = default_degree(n)
        else:
            k = _check_int("degree", degree, 2)
            k = min(n - 1, k + (k % 2))  # round up to even, cap at the complete graph
        t = default_threshold(k) if threshold is None else threshold
        return cls(
            round_id=round_id,
            nonce=nonce,
            cohort=members,
            bits=bits,
            length=length,
            degree=k,
            threshold=t,
            amortized=amortized,
        )

    @classmethod
    def of_plan(cls, plan: RoundPlan) -> RoundConfig:
        """The secure-aggregation parameters a round plan states (a decoded plan's are
        consistent: the wire checks the same neighbourhood rule).

        Raises:
            ValueError: they do not form a valid RoundConfig.
        """
        return cls(round_id=plan.round_id, nonce=plan.nonce, cohort=plan.cohort,
                   bits=plan.bits, length=plan.length, degree=plan.degree,
                   threshold=plan.threshold, amortized=plan.secagg == "amortized")

    def to_wire(self) -> dict[str, Any]:
        """The digest's input (not a message on the wire): a msgpack-able map that carries
        the protocol version, so the digest binds it."""
        return {
            "v": PROTOCOL_VERSION,
            "kind": "round_config",
            "round": self.round_id,
            "nonce": self.nonce,
            "cohort": list(self.cohort),
            "bits": self.bits,
            "length": self.length,
            "degree": self.degree,
            "threshold": self.threshold,
            "amortized": self.amortized,
        }

    @classmethod
    def from_wire(cls, obj: object) -> RoundConfig:
        """Inverse of :meth:`to_wire`.

        Raises:
            RemoteProtocolError: not the map :meth:`to_wire` makes, or invalid parameters.
        """
        if not isinstance(obj, dict) or set(obj) != _CONFIG_KEYS:
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise RemoteProtocolError(f"round_config must be a map of exactly "
                                      f"{sorted(_CONFIG_KEYS)}, got {got}")
        v = obj["v"]
        if type(v) is not int or v != PROTOCOL_VERSION or obj["kind"] != "round_config":
            raise RemoteProtocolError(f"round_config: expected version {PROTOCOL_VERSION} and "
                                      f"kind 'round_config', got {v!r}, {obj['kind']!r}")
        cohort = obj["cohort"]
        try:
            if not isinstance(cohort, list) or len(set(map(str, cohort))) != len(cohort):
                raise ValueError(f"cohort must be a list of distinct devices, got {cohort!r}")
            if not isinstance(obj["amortized"], bool):
                raise ValueError(f"amortized must be a bool, got {obj['amortized']!r}")
            if not isinstance(obj["nonce"], bytes):
                raise ValueError(f"nonce must be bytes, got {type(obj['nonce']).__name__}")
            return cls(round_id=obj["round"], nonce=obj["nonce"], cohort=tuple(cohort),
                       bits=obj["bits"], length=obj["length"], degree=obj["degree"],
                       threshold=obj["threshold"], amortized=obj["amortized"])
        except ValueError as e:
            raise RemoteProtocolError(f"round_config: {e}") from None

    def digest(self) -> bytes:
        """SHA-256 of the config's canonical msgpack encoding (binds signatures and keys)."""
        return _config_digest(self)

    def neighbours(self, device: str) -> tuple[str, ...]:
        """The device's neighbours (sorted)."""
        return self.graph()[device]

    def graph(self) -> Mapping[str, tuple[str, ...]]:
        """The whole neighbour graph (``hazmat.graph.neighbour_graph``)."""
        return neighbour_graph(self.cohort, degree=self.degree, seed=self.nonce)

    def share_point(self, device: str) -> int:
        """The device's Shamir x: 1 + its index in the sorted cohort."""
        return _cohort_index(self.cohort)[device] + 1


@functools.lru_cache(maxsize=16)
def _config_digest(config: RoundConfig) -> bytes:
    return hashlib.sha256(
        _CONFIG_LABEL + msgpack.packb(config.to_wire(), use_bin_type=True)
    ).digest()


@functools.lru_cache(maxsize=16)
def _cohort_index(cohort: tuple[str, ...]) -> Mapping[str, int]:
    return MappingProxyType({d: i for i, d in enumerate(cohort)})
