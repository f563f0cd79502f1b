"""Secure aggregation, the recipe layer: keys, round parameters, the device's protocol.

The aggregator learns the sum of a cohort's vectors in Z_{2^b} and nothing else, also
when devices vanish mid-round. Layers, as pyca/cryptography layers ``hazmat`` under
recipes (the messages are ``edge_sdk.wire.messages``; ``tests/golden/secagg_vectors.json``
pins the formats)::

    edge_sdk.secagg            this package: what a device or a tool uses
      identity                 DeviceIdentity, AggregatorIdentity, Registry, Enrollment
      config                   RoundConfig (cohort, ring, neighbourhood, digest)
      client                   SecAggClient, AmortizedSecAggClient, PairwiseSeeds
    aggregator.secagg_server   the aggregator's side (relay, recovery, unmasking)
    edge_sdk.hazmat            primitives, misusable on their own:
      masking                  mask PRG, seed derivations, sign convention, mask/unmask
      shamir                   Shamir t-of-n over GF(2^521 - 1), share encoding
      graph                    SecAgg+ neighbour graph, t-core pruning, survivor rules
      prg, ring                HKDF and ChaCha20 streams; the ring Z_{2^b}

Protocols
---------

* **SecAgg with SecAgg+ neighbourhoods** (Bonawitz et al., CCS 2017, Fig. 4 "practical
  secure aggregation", with double masking; Bell et al., CCS 2020, SecAgg+): every device
  masks only toward its neighbours in a random k-regular graph over the cohort
  (``hazmat.graph.neighbour_graph``, k ~ 2 log2 n), and Shamir-shares its secrets t-of-k among
  those neighbours. Per round, device u draws two X25519 key pairs (``mask`` and ``enc``)
  and a self-mask seed b_u, and sends::

      y_u = x_u + PRG(b_u) + sum_{v in N(u) ∩ U2} sign(u, v) * PRG(s_uv)      (mod 2^b)

  with s_uv = HKDF(X25519(mask_u, mask_v)). Shares of mask_u's secret key and of b_u go
  to each neighbour encrypted with ChaCha20-Poly1305 under HKDF(X25519(enc_u, enc_v)),
  relayed by the aggregator. Recovery: for a device that dropped after sharing, its
  surviving neighbours reveal shares of its mask key (the aggregator recomputes the
  pairwise masks toward survivors); for a survivor, shares of b_u. A device never reveals
  both for the same owner (``UnmaskRefused``), and with ``2t > k`` the aggregator can
  never hold t shares of both, so a late upload stays hidden behind its self mask.

* **Amortized variant** (Hu, Guo, Gong, "zCDP secure aggregation", Sec. IV-B, Fig. 2,
  eqs. (7)-(9)): pairwise seeds are agreed once at enrollment (static X25519 between the
  long-term ``agree`` keys, ``hazmat.masking.amortized_pair_seed``); each round every device masks
  with ``PRF(seed_uv, round)`` (``hazmat.masking.amortized_round_seed``) toward its neighbours, with
  no key exchange, no self mask and no shares. The paper assumes no dropouts; we add a
  recovery in which survivors reveal the *round* seeds (never the long-term seed) toward
  neighbours the aggregator reports as dropped. Its dropout story is weaker, by design:

  - no threshold: one survivor's answer removes a pairwise mask; an aggregator that
    falsely reports v as dropped to all of v's neighbours unmasks v's upload completely
    (there is no self mask to protect a late or withheld upload). Only an
    honest-but-curious aggregator is tolerated. A device refuses a request that would
    leave fewer than t of its own neighbours masked with it (that would expose its own
    input), which bounds, but does not remove, the exposure;
  - no redundancy: a pairwise round seed is known only to its two endpoints, so a
    survivor that drops during recovery fails the round;
  - round ids must never repeat (a repeated mask leaks ``x - x'``); the device refuses any
    round id not above the last one it masked for (:class:`PairwiseSeeds` holds it; the
    caller persists it with the ledger, before the upload leaves the device);
  - no forward secrecy: a stolen long-term key reveals every round's masks with its peers.

  A round plan selects it (``RoundPlan.secagg == "amortized"``, protocol 8, issue 18): the
  aggregator's round machine then drives :class:`aggregator.secagg_server.AmortizedSecAggServer`
  (one upload stage, then reveals only if a member did not upload) and
  ``edge_sdk.session.DeviceSession`` masks and uploads right after training, taking the
  last round it masked for from its ledger's reservations (durable before any upload). The
  privacy accounting is unchanged: the aggregate view assumes a semi-honest aggregator and
  at most ``max_colluders < t`` colluding members: a device reveals nothing that would leave
  fewer than t of its neighbours masked with it, so every honest member keeps at least
  ``t - max_colluders >= 1`` pairwise masks with honest neighbours, which only the sum
  cancels. For a
  small model it is what keeps the uplink near the vector's own size (``fedge bench
  small-upload``: 1.26x float32 for 650 parameters in a cohort of 10, against 2.69x).

* **Sparse rounds**: with rand-k the whole cohort keeps the same coordinate set omega
  (``compress.coordinate_set``, derived from the round seed, never sent). The round's
  ``length`` is k; devices mask and send only the k kept values (pass the dense vector
  and ``coordinates=omega`` to :meth:`SecAggClient.mask_input`), so masks are expanded
  over omega only, and the aggregator scatters the k sums back
  (``SecAggServer.finalize_dense``).

Trust model
-----------

The aggregator is assumed **semi-honest** (honest-but-curious): it follows the protocol
and may only study what it receives. Bonawitz et al.'s active-adversary defences are not
implemented, above all the consistency-check round (Fig. 4, round 3: survivors sign the
set U3 and check each other's signatures before revealing shares). Without it an
aggregator that tells different devices different survivor sets can collect both the
mask-key share and the self-mask share of one device and unmask that device's input
alone. What a device does check: every message's signature and round, never both shares
of one owner in one request (``UnmaskRefused``), only one request per round, and,
in ``edge_sdk.session``, that the request's ``survivor_count`` is at least the plan's
``min_survivors`` and agrees with the survivors it names (exactly, with the complete
graph). Devices colluding with the aggregator are tolerated up to t - 1 of them (fewer
than t shares of any honest device's secrets); the fleet states the number it assumes
as ``RoundPlan.max_colluders`` (< t), which the accounting of the secure sum uses.

Exceptions (defined in :mod:`edge_sdk.errors`, whose docstring draws the whole tree)::

    EdgeError
     +-- LocalProtocolError     this endpoint's caller did wrong (a call out of order)
     +-- RemoteProtocolError    a peer sent something invalid (malformed, bad signature,
     |    |                     outsider, wrong round, wrong stage); no state changed
     |    +-- ReplayedMessage   an exact copy of an accepted message (harmless under QoS 1)
     |    +-- UnmaskRefused     the aggregator asked this device for what it must not reveal
     +-- RoundFailed            too few devices left to finish; nothing was unmasked

Bad arguments from the local caller stay ``ValueError``.
"""

from edge_sdk.secagg.client import (
    AmortizedSecAggClient,
    ClientState,
    PairwiseSeeds,
    SecAggClient,
)
from edge_sdk.secagg.config import RoundConfig
from edge_sdk.secagg.identity import AggregatorIdentity, DeviceIdentity, Enrollment, Registry

__all__ = [
    "AggregatorIdentity",
    "AmortizedSecAggClient",
    "ClientState",
    "DeviceIdentity",
    "Enrollment",
    "PairwiseSeeds",
    "Registry",
    "RoundConfig",
    "SecAggClient",
]
