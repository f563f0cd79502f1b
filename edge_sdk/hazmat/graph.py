"""The SecAgg+ neighbour graph and the rules that decide a round's survivors.

Hazmat (see :mod:`edge_sdk.hazmat`): pure functions of public data (the cohort, the round's
nonce, who reached which stage); the aggregator's ``SecAggServer`` calls them, and so can a
plain sum that must end a round exactly as secure aggregation would.

Neighbour graph (:func:`neighbour_graph`): a Harary graph H_{k,n} (node at position i is
joined to positions i +- 1 .. i +- k/2 mod n, k even) over a uniformly random permutation
of the sorted cohort, the permutation drawn by Fisher-Yates from the graph key's PRG
words with rejection (``hazmat.prg.fisher_yates``, as ``compress.coordinate_set``), the
graph key being ``HKDF(ikm=nonce, salt=None, info=b"fedge/secagg/v1/graph")``.
k >= n - 1 gives the complete graph, i.e. the original SecAgg. It is a k-regular,
k-connected graph; the random placement plays the role of the random graph of Bell et al.
(an aggregator that grinds nonces could bias it; we assume an honest-but-curious aggregator
there). A wire format: pinned by ``tests/golden/secagg_vectors.json``.

Survivors (Bonawitz et al. 2017 Fig. 4 with SecAgg+ neighbourhoods, Bell et al. 2020;
device sets U1 advertised keys, U2 shared keys, U3 uploaded, answering recovery):

* closing the first two stages keeps the t-core of those who answered (:func:`prune`):
  a device left with fewer than t live neighbours could never have its shares recovered,
  and dropping it before it masks is free (:func:`stage_core`);
* closing the upload stage, every survivor and every dropped device with a surviving
  neighbour must keep at least t survivors among its neighbours, else the round fails
  before any share is requested (:func:`upload_problem`);
* recovery needs at least t answering holders of every needed secret: the mask key of
  each dropped device with a surviving neighbour, the self-mask seed of each survivor
  (:func:`recovery_owners`, :func:`share_shortfall`).

:func:`survivor_sets` applies all of them to who reached each stage.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeAlias

from edge_sdk._validate import check_int as _check_int
from edge_sdk.hazmat import prg

__all__ = [
    "GRAPH_INFO",
    "Graph",
    "Survivors",
    "default_degree",
    "default_threshold",
    "neighbour_graph",
    "neighbourhood_problem",
    "prune",
    "recovery_owners",
    "share_shortfall",
    "stage_core",
    "survivor_sets",
    "upload_problem",
]

GRAPH_INFO = b"fedge/secagg/v1/graph"

Graph: TypeAlias = Mapping[str, tuple[str, ...]]
"""{device: sorted tuple of its neighbours}; symmetric."""


def default_degree(n: int) -> int:
    """SecAgg+ neighbourhood size for a cohort of n: ``min(n - 1, 2 * ceil(log2 n))``.

    Bell et al. 2020 need k = O(log n); 2 log2 n keeps each neighbourhood connected to
    the rest with overwhelming probability for the dropout rates we target.
    """
    n = _check_int("cohort size", n, 3)
    return min(n - 1, 2 * math.ceil(math.log2(n)))


def default_threshold(degree: int) -> int:
    """Shamir threshold for k share holders: ``k // 2 + 1``, the least t with 2t > k.

    2t > k is what makes "never both" safe: the aggregator cannot gather t mask-key shares
    and t self-mask shares of one device from disjoint halves of its neighbours.
    """
    k = _check_int("degree", degree, 2)
    return k // 2 + 1


def neighbourhood_problem(n: int, degree: int, threshold: int) -> str | None:
    """What is wrong with a SecAgg+ neighbourhood of ``degree`` and Shamir ``threshold`` over
    a cohort of ``n`` (integers, n >= 3), or None: the degree is the complete graph's
    n - 1 or even in [2, n - 1) (a Harary graph), and k/2 < t <= k (2t > k, see
    :func:`default_threshold`)."""
    if not 2 <= degree <= n - 1:
        return f"degree must be in [2, {n - 1}], got {degree}"
    if degree < n - 1 and degree % 2:
        return (f"degree must be even (Harary graph) or the full n - 1 = {n - 1}, "
                f"got {degree}")
    if not 1 <= threshold <= degree:
        return f"threshold must be in [1, {degree}], got {threshold}"
    if 2 * threshold <= degree:
        return (f"threshold must exceed degree / 2 = {degree / 2} (else the aggregator could "
                f"collect both kinds of shares of one device), got {threshold}")
    return None


def _permutation(seed: bytes, n: int) -> list[int]:
    """The graph's uniform permutation of range(n): Fisher-Yates on the words of
    ``HKDF(seed, info=GRAPH_INFO)`` (module docstring; :mod:`edge_sdk.hazmat.prg`)."""
    words = prg.WordStream(prg.derive_key(seed, info=GRAPH_INFO), chunk=n + 16)
    return prg.fisher_yates(words, n, n)


@functools.lru_cache(maxsize=16)
def _graph(cohort: tuple[str, ...], degree: int, seed: bytes) -> Graph:
    n = len(cohort)
    if degree >= n - 1:
        return MappingProxyType({u: tuple(v for v in cohort if v != u) for u in cohort})
    order = [cohort[i] for i in _permutation(seed, n)]
    half = degree // 2
    adj: dict[str, tuple[str, ...]] = {}
    for i, u in enumerate(order):
        peers = {order[(i + j) % n] for j in range(1, half + 1)}
        peers |= {order[(i - j) % n] for j in range(1, half + 1)}
        adj[u] = tuple(sorted(peers))
    return MappingProxyType(dict(sorted(adj.items())))


def neighbour_graph(
    cohort: Sequence[str], *, degree: int, seed: bytes
) -> Graph:
    """The SecAgg+ neighbour graph of a cohort (module docstring): Harary H_{k,n} placed by
    a seeded random permutation, or the complete graph when ``degree >= n - 1``.

    Args:
        cohort: distinct device ids, sorted.
        degree: k, even and >= 2 unless it is n - 1.
        seed: the round's public nonce (>= 16 bytes).

    Returns:
        Read-only {device: sorted tuple of its k neighbours}; symmetric.
    """
    ids = tuple(cohort)
    if list(ids) != sorted(set(ids)):
        raise ValueError("cohort must be sorted and distinct")
    n = len(ids)
    if n < 3:
        raise ValueError(f"a cohort needs at least 3 devices, got {n}")
    k = _check_int("degree", degree, 2, n - 1)
    if k < n - 1 and k % 2:
        raise ValueError(f"degree must be even (Harary graph) or n - 1 = {n - 1}, got {k}")
    if not isinstance(seed, bytes) or len(seed) < 16:
        raise ValueError("seed must be at least 16 bytes")
    return _graph(ids, k, bytes(seed))


# --------------------------------------------------------------------------- survivors


def prune(members: Collection[str], graph: Graph, t: int) -> frozenset[str]:
    """Largest subset of ``members`` in which every device keeps at least t neighbours
    (the t-core)."""
    alive = set(members)
    changed = True
    while changed:
        changed = False
        for u in sorted(alive):
            if sum(v in alive for v in graph[u]) < t:
                alive.discard(u)
                changed = True
    return frozenset(alive)


def stage_core(
    reached: Collection[str], graph: Graph, t: int, *, did: str
) -> tuple[frozenset[str], str | None]:
    """Close a key stage: the t-core of the devices that ``did`` it (e.g. "advertised
    keys"), and why the round fails (None: it goes on) when the core is empty."""
    core = prune(reached, graph, t)
    if core:
        return core, None
    return core, f"only {len(reached)} devices {did}; no device has {t} live neighbours"


def upload_problem(
    graph: Graph, t: int, shared: Collection[str], uploaded: Collection[str]
) -> str | None:
    """Close the upload stage: why the round must fail before any share is requested, or
    None. Every survivor (in ``uploaded``) and every dropped device of ``shared`` with a
    surviving neighbour must keep at least t surviving neighbours; the first device that
    does not, in sorted order, is named."""
    u3 = set(uploaded)
    if not u3:
        return "no device uploaded a masked input"
    for u in sorted(shared):
        live = [v for v in graph[u] if v in u3]
        needed = u in u3 or bool(live)  # a dropped device matters if a survivor masked with it
        if needed and len(live) < t:
            what = "survivor" if u in u3 else "dropped device"
            return (
                f"{what} {u!r} has {len(live)} surviving neighbours, below the threshold "
                f"{t}; its {'self mask' if u in u3 else 'pairwise masks'} cannot be removed"
            )
    return None


def recovery_owners(
    graph: Graph, shared: Collection[str], uploaded: Collection[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(dropped, survivors), each sorted: the devices whose mask keys recovery must
    rebuild (in ``shared``, not uploaded, with a surviving neighbour) and those whose
    self-mask seeds it must rebuild (every survivor)."""
    u3 = set(uploaded)
    dropped = tuple(sorted(v for v in set(shared) - u3 if any(u in u3 for u in graph[v])))
    return dropped, tuple(sorted(u3))


def share_shortfall(
    graph: Graph,
    t: int,
    shared: Collection[str],
    uploaded: Collection[str],
    answered: Collection[str],
) -> str | None:
    """Recovery: why it cannot rebuild every needed secret, or None. A secret's shares
    are held by its owner's neighbours; each answering survivor gives one share of each
    needed secret it holds, so each owner of :func:`recovery_owners` needs at least t
    answering neighbours. The first short owner (dropped ones first) is named."""
    replied = set(answered)
    for group in recovery_owners(graph, shared, uploaded):
        for owner in group:
            got = sum(u in replied for u in graph[owner])
            if got < t:
                return f"only {got} shares of {owner!r} came back, below the threshold {t}"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Survivors:
    """How one round ends, given who reached each stage (:func:`survivor_sets`).

    Attributes:
        u1, u2, u3: the devices kept after the key advertisement, the share exchange and
            the upload (empty from the stage that failed on).
        failed: why the round fails (the aggregator's ``RoundFailed`` text), or None.
    """

    u1: frozenset[str]
    u2: frozenset[str]
    u3: frozenset[str]
    failed: str | None


def survivor_sets(
    graph: Graph,
    t: int,
    *,
    advertised: Collection[str],
    shared: Collection[str],
    uploaded: Collection[str],
    answered: Collection[str],
) -> Survivors:
    """The survivor rules of one round, in stage order (module docstring).

    Each stage's set is cut to the devices kept at the stage before (a device the
    aggregator dropped cannot answer later). ``u3`` is the set whose inputs are in the sum
    when ``failed`` is None.
    """
    empty: frozenset[str] = frozenset()
    u1, why = stage_core(advertised, graph, t, did="advertised keys")
    if why:
        return Survivors(u1=empty, u2=empty, u3=empty, failed=why)
    reached = [u for u in shared if u in u1]
    u2, why = stage_core(reached, graph, t, did="shared keys")
    if why:
        return Survivors(u1=u1, u2=empty, u3=empty, failed=why)
    u3 = frozenset(u for u in uploaded if u in u2)
    why = upload_problem(graph, t, u2, u3)
    if why:
        return Survivors(u1=u1, u2=u2, u3=empty, failed=why)
    why = share_shortfall(graph, t, u2, u3, [u for u in answered if u in u3])
    return Survivors(u1=u1, u2=u2, u3=u3, failed=why)
