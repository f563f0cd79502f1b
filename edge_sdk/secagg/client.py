"""The device's side of secure aggregation: two sans-I/O client state machines.

:class:`SecAggClient` runs one SecAgg(+) round (Bonawitz et al. 2017 Fig. 4 with SecAgg+
neighbourhoods, Bell et al. 2020); :class:`AmortizedSecAggClient` one round of the
amortized variant (Hu, Guo, Gong, zCDP secure aggregation, Fig. 2), with
:class:`PairwiseSeeds` holding its long-term seeds. See :mod:`edge_sdk.secagg` for both
protocols and the trust model. Shares are sealed with ChaCha20-Poly1305 under the pair's
share key, with associated data ``b"fedge/secagg/v1/share" + digest + lp(sender) +
lp(recipient)`` (``lp``: :func:`edge_sdk.hazmat.masking.length_prefixed`).
"""

from __future__ import annotations

import enum
import os
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from edge_sdk._validate import check_int as _check_int
from edge_sdk.errors import LocalProtocolError, RemoteProtocolError, UnmaskRefused
from edge_sdk.hazmat.masking import (
    SEED_BYTES,
    amortized_pair_seed,
    amortized_round_seed,
    derive_pairwise_seed,
    derive_share_key,
    length_prefixed,
    mask,
    mask_sign,
)
from edge_sdk.hazmat.ring import Ring
from edge_sdk.hazmat.shamir import (
    SHARE_BYTES,
    RandomBytes,
    share_from_bytes,
    share_to_bytes,
    split_secret,
)
from edge_sdk.secagg.config import RoundConfig

# the package's own private helpers (one package, one protocol)
from edge_sdk.secagg.identity import DeviceIdentity, Registry, _raw_private, _raw_public
from edge_sdk.wire import schema
from edge_sdk.wire.chunking import DEFAULT_MAX_PACKET, split_masked
from edge_sdk.wire.messages import (
    AdvertiseKeys,
    EncryptedShare,
    ForwardedShares,
    MaskedPart,
    NeighbourKeys,
    RevealRequest,
    RevealResponse,
    ShareKeys,
    UnmaskRequest,
    UnmaskResponse,
)
from edge_sdk.wire.schema import ROUND_HI as _ROUND_HI

__all__ = ["AmortizedSecAggClient", "ClientState", "PairwiseSeeds", "SecAggClient"]

_SHARE_AD_LABEL = b"fedge/secagg/v1/share"
_NONCE_BYTES = 12  # ChaCha20-Poly1305


def _sign_with(msg: Any, signer: DeviceIdentity, digest: bytes) -> Any:
    """``msg`` signed by ``signer`` over the wire's signing bytes, bound to the round's
    configuration ``digest``."""
    return schema.sign(msg, signer, context=digest)


def _masked_parts(
    y: np.ndarray, config: RoundConfig, identity: DeviceIdentity, digest: bytes,
    max_packet: int,
) -> tuple[MaskedPart, ...]:
    """The masked vector ``y`` packed at the ring's width, cut below ``max_packet`` and
    each part signed."""
    parts = split_masked(round_id=config.round_id, sender=identity.device, bits=config.bits,
                         count=config.length, data=Ring(bits=config.bits).pack(y),
                         max_packet=max_packet)
    return tuple(_sign_with(p, identity, digest) for p in parts)


def _check_round(msg: Any, config: RoundConfig) -> None:
    if msg.round_id != config.round_id:
        raise RemoteProtocolError(
            f"{msg.KIND} is for round {msg.round_id}, this is round {config.round_id}"
        )


def _share_ad(digest: bytes, sender: str, recipient: str) -> bytes:
    return _SHARE_AD_LABEL + digest + length_prefixed(sender) + length_prefixed(recipient)
# --------------------------------------------------------------------------- SecAgg(+)


class ClientState(enum.Enum):
    """Where a device is in one round (h11-style: every method is legal in one state)."""

    IDLE = "idle"  # -> advertise()
    ADVERTISED = "advertised"  # -> share_keys(NeighbourKeys)
    SHARED = "shared"  # -> mask_input(ForwardedShares, x)
    MASKED = "masked"  # -> unmask(UnmaskRequest) / reveal(RevealRequest)
    DONE = "done"  # answered recovery (an identical request gets the same answer)


def _dh(private: X25519PrivateKey, public: bytes, who: str) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as e:  # e.g. a low-order point gives the all-zero secret
        raise RemoteProtocolError(f"unusable X25519 key from {who!r}: {e}") from None


class SecAggClient:
    """A device's side of one SecAgg(+) round, sans-I/O: messages in, messages out.

    Bonawitz et al. 2017 Fig. 4 (rounds 0-2 and 4; the consistency-check round 3 of the
    actively secure version is not implemented) restricted to neighbourhoods as in SecAgg+
    (Bell et al. 2020). Use::

        c = SecAggClient(identity=me, registry=reg, config=cfg)
        adv = c.advertise()                       # -> aggregator
        sk = c.share_keys(neighbour_keys)         # -> aggregator
        parts = c.mask_input(forwarded_shares, x) # -> aggregator (signed masked parts)
        ur = c.unmask(unmask_request)             # -> aggregator

    Every inbound message is checked (round, recipient, aggregator signature, each
    relayed peer message's own signature, membership) before anything changes; a bad
    one raises :class:`RemoteProtocolError` and leaves the client as it was.

    Args:
        identity: this device's long-term keys; must be enrolled and in the cohort.
        registry: everyone's public keys.
        config: the round (``amortized`` must be False).
        random_bytes: randomness for keys, seeds, polynomial coefficients and nonces.
    """

    def __init__(
        self,
        *,
        identity: DeviceIdentity,
        registry: Registry,
        config: RoundConfig,
        random_bytes: RandomBytes = os.urandom,
    ) -> None:
        if config.amortized:
            raise ValueError("config.amortized is True: use AmortizedSecAggClient")
        me = identity.device
        if me not in config.cohort:
            raise ValueError(f"device {me!r} is not in the round's cohort")
        if registry.devices.get(me) != identity.enrollment():
            raise ValueError(f"device {me!r} is not enrolled with these keys")
        missing = [d for d in config.cohort if d not in registry.devices]
        if missing:
            raise ValueError(f"cohort members not enrolled: {missing}")
        self._id = identity
        self._reg = registry
        self._cfg = config
        self._digest = config.digest()
        self._rand = random_bytes
        self._neighbours = frozenset(config.neighbours(me))
        self._state = ClientState.IDLE
        self._mask_sk: X25519PrivateKey | None = None
        self._enc_sk: X25519PrivateKey | None = None
        self._self_seed = b""
        self._advert: AdvertiseKeys | None = None
        self._peer_keys: dict[str, AdvertiseKeys] = {}
        self._pair_seeds: dict[str, bytes] = {}
        self._share_keys: dict[str, bytes] = {}
        self._held: dict[str, tuple[int, int]] = {}
        self._answer: tuple[UnmaskRequest, UnmaskResponse] | None = None

    @property
    def device(self) -> str:
        return self._id.device

    @property
    def state(self) -> ClientState:
        return self._state

    def _expect(self, state: ClientState, what: str) -> None:
        if self._state is not state:
            raise RemoteProtocolError(
                f"{what} is not expected in state {self._state.value} (expected "
                f"{state.value}); ignored"
            )

    def _check_from_aggregator(self, msg: Any) -> None:
        _check_round(msg, self._cfg)
        if msg.recipient != self.device:
            raise RemoteProtocolError(
                f"{msg.KIND} is addressed to {msg.recipient!r}, not {self.device!r}"
            )
        self._reg.verify(None, msg.sig, msg.signing_bytes(self._digest), msg.KIND)

    def advertise(self) -> AdvertiseKeys:
        """Round 0: fresh X25519 key pairs for masks and for share encryption, signed."""
        if self._state is not ClientState.IDLE:
            raise LocalProtocolError(f"advertise() called in state {self._state.value}")
        mask_sk = X25519PrivateKey.from_private_bytes(self._rand(32))
        enc_sk = X25519PrivateKey.from_private_bytes(self._rand(32))
        advert = _sign_with(
            AdvertiseKeys(
                round_id=self._cfg.round_id,
                sender=self.device,
                mask_key=_raw_public(mask_sk),
                enc_key=_raw_public(enc_sk),
            ),
            self._id,
            self._digest,
        )
        self._mask_sk, self._enc_sk, self._advert = mask_sk, enc_sk, advert
        self._state = ClientState.ADVERTISED
        return advert  # type: ignore[no-any-return]

    def share_keys(self, msg: NeighbourKeys) -> ShareKeys:
        """Round 1: check the neighbours' keys; Shamir-share the mask key and a fresh
        self-mask seed b_u t-of-k among them; seal each pair of shares for its holder."""
        if not isinstance(msg, NeighbourKeys):
            raise RemoteProtocolError(f"expected neighbour_keys, got {type(msg).__name__}")
        self._expect(ClientState.ADVERTISED, "neighbour_keys")
        self._check_from_aggregator(msg)
        assert self._mask_sk is not None and self._enc_sk is not None
        peers: dict[str, AdvertiseKeys] = {}
        for adv in msg.adverts:
            _check_round(adv, self._cfg)
            if adv.sender not in self._neighbours:
                raise RemoteProtocolError(
                    f"neighbour_keys carries keys of {adv.sender!r}, not a neighbour of "
                    f"{self.device!r}"
                )
            if adv.sender in peers:
                raise RemoteProtocolError(f"neighbour_keys carries {adv.sender!r} twice")
            self._reg.verify(adv.sender, adv.sig, adv.signing_bytes(self._digest), "advertise_keys")
            peers[adv.sender] = adv
        t = self._cfg.threshold
        if len(peers) < t:
            raise RemoteProtocolError(
                f"only {len(peers)} neighbours advertised keys, below the threshold {t}: "
                f"this device's shares could never be recovered"
            )
        pair_seeds, share_keys = {}, {}
        for v, adv in peers.items():
            pair_seeds[v] = derive_pairwise_seed(
                _dh(self._mask_sk, adv.mask_key, v), context=self._digest
            )
            share_keys[v] = derive_share_key(
                _dh(self._enc_sk, adv.enc_key, v), context=self._digest
            )
        self_seed = self._rand(SEED_BYTES)
        holders = sorted(peers)
        xs = [self._cfg.share_point(v) for v in holders]
        key_shares = split_secret(
            int.from_bytes(_raw_private(self._mask_sk), "big"),
            threshold=t,
            xs=xs,
            random_bytes=self._rand,
        )
        seed_shares = split_secret(
            int.from_bytes(self_seed, "big"), threshold=t, xs=xs, random_bytes=self._rand
        )
        sealed = []
        for v, x in zip(holders, xs, strict=True):
            nonce = self._rand(_NONCE_BYTES)
            ct = ChaCha20Poly1305(share_keys[v]).encrypt(
                nonce,
                share_to_bytes(key_shares[x]) + share_to_bytes(seed_shares[x]),
                _share_ad(self._digest, self.device, v),
            )
            sealed.append(
                _sign_with(
                    EncryptedShare(
                        round_id=self._cfg.round_id,
                        sender=self.device,
                        recipient=v,
                        nonce=nonce,
                        ciphertext=ct,
                    ),
                    self._id,
                    self._digest,
                )
            )
        out = _sign_with(
            ShareKeys(round_id=self._cfg.round_id, sender=self.device, shares=tuple(sealed)),
            self._id,
            self._digest,
        )
        self._peer_keys, self._pair_seeds, self._share_keys = peers, pair_seeds, share_keys
        self._self_seed = self_seed
        self._state = ClientState.SHARED
        return out  # type: ignore[no-any-return]

    def mask_input(
        self, msg: ForwardedShares, x: np.ndarray, *, coordinates: np.ndarray | None = None,
        max_packet: int = DEFAULT_MAX_PACKET,
    ) -> tuple[MaskedPart, ...]:
        """Round 2: open the neighbours' shares, then mask x toward exactly those
        neighbours (U2) and with the self mask.

        Args:
            msg: the shares the aggregator forwards (from neighbours that shared keys).
            x: residues in [0, 2^bits): ``config.length`` of them, or a dense vector when
                ``coordinates`` is given.
            coordinates: sparse round: the round's rand-k set omega (``config.length``
                sorted indices); only ``x[omega]`` is masked and sent.
            max_packet: the largest encoded part (bytes, ``wire.chunking.split_masked``).

        Returns:
            the masked vector's parts (raw packed residues), each signed.

        Raises:
            RemoteProtocolError: a bad forwarded message (nothing changes).
            ValueError: x (or coordinates) not as described.
        """
        if not isinstance(msg, ForwardedShares):
            raise RemoteProtocolError(f"expected forwarded_shares, got {type(msg).__name__}")
        values = _select(x, coordinates, self._cfg)
        self._expect(ClientState.SHARED, "forwarded_shares")
        self._check_from_aggregator(msg)
        held: dict[str, tuple[int, int]] = {}
        for enc in msg.shares:
            _check_round(enc, self._cfg)
            owner = enc.sender
            if owner not in self._peer_keys:
                raise RemoteProtocolError(
                    f"forwarded share from {owner!r}, whose keys this device never received"
                )
            if enc.recipient != self.device:
                raise RemoteProtocolError(f"forwarded share is addressed to {enc.recipient!r}")
            if owner in held:
                raise RemoteProtocolError(f"two forwarded shares from {owner!r}")
            self._reg.verify(owner, enc.sig, enc.signing_bytes(self._digest), "encrypted_share")
            try:
                plain = ChaCha20Poly1305(self._share_keys[owner]).decrypt(
                    enc.nonce, enc.ciphertext, _share_ad(self._digest, owner, self.device)
                )
                held[owner] = (
                    share_from_bytes(plain[:SHARE_BYTES]),
                    share_from_bytes(plain[SHARE_BYTES:]),
                )
            except (InvalidTag, ValueError):
                raise RemoteProtocolError(
                    f"the share sealed by {owner!r} does not open or decode"
                ) from None
        t = self._cfg.threshold
        if len(held) < t:
            raise RemoteProtocolError(
                f"only {len(held)} neighbours shared keys, below the threshold {t}"
            )
        terms = [(1, self._self_seed)] + [
            (mask_sign(self.device, v), self._pair_seeds[v]) for v in sorted(held)
        ]
        y = mask(values, bits=self._cfg.bits, terms=terms)
        out = _masked_parts(y, self._cfg, self._id, self._digest, max_packet)
        self._held = held
        self._state = ClientState.MASKED
        return out

    def unmask(self, msg: UnmaskRequest) -> UnmaskResponse:
        """Round 4: reveal mask-key shares of the dropped neighbours and self-mask shares
        of the surviving ones; never both kinds for one owner, and only one request.

        Raises:
            UnmaskRefused: the request names an owner in both lists, this device itself,
                or follows a different earlier request (nothing is revealed).
            RemoteProtocolError: otherwise malformed or unsigned request.
        """
        if not isinstance(msg, UnmaskRequest):
            raise RemoteProtocolError(f"expected unmask_request, got {type(msg).__name__}")
        if self._state is ClientState.DONE and self._answer is not None:
            self._check_from_aggregator(msg)
            if msg == self._answer[0]:
                return self._answer[1]
            raise UnmaskRefused(
                f"{self.device!r} already answered a different unmask request this round; "
                f"answering another could reveal both shares of one device"
            )
        self._expect(ClientState.MASKED, "unmask_request")
        self._check_from_aggregator(msg)
        both = set(msg.dropped) & set(msg.survivors)
        if both:
            raise UnmaskRefused(
                f"unmask request asks for both the mask-key and the self-mask shares of "
                f"{sorted(both)}; revealing both would unmask their input"
            )
        if self.device in msg.dropped or self.device in msg.survivors:
            raise UnmaskRefused(f"unmask request names the recipient {self.device!r} itself")
        unknown = sorted(set(msg.dropped + msg.survivors) - set(self._held))
        if unknown:
            raise RemoteProtocolError(f"{self.device!r} holds no shares of {unknown}")
        reply = _sign_with(
            UnmaskResponse(
                round_id=self._cfg.round_id,
                sender=self.device,
                mask_key_shares=tuple((o, share_to_bytes(self._held[o][0])) for o in msg.dropped),
                self_seed_shares=tuple(
                    (o, share_to_bytes(self._held[o][1])) for o in msg.survivors
                ),
            ),
            self._id,
            self._digest,
        )
        self._answer = (msg, reply)
        self._state = ClientState.DONE
        return reply  # type: ignore[no-any-return]


def _select(x: object, coordinates: object, config: RoundConfig) -> np.ndarray:
    a = np.asarray(x)
    if coordinates is not None:
        idx = np.asarray(coordinates)
        if idx.ndim != 1 or idx.dtype.kind not in "iu" or idx.size != config.length:
            raise ValueError(
                f"coordinates must be {config.length} integer indices, got dtype "
                f"{idx.dtype} shape {idx.shape}"
            )
        if a.ndim != 1:
            raise ValueError(f"x must be 1-D, got shape {a.shape}")
        if idx.size and (
            idx.min() < 0 or idx.max() >= a.size or np.any(np.diff(idx.astype(np.int64)) <= 0)
        ):
            raise ValueError(f"coordinates must be sorted distinct indices into x (len {a.size})")
        a = a[idx]
    if a.ndim != 1 or a.size != config.length:
        raise ValueError(
            f"x must be 1-D with config.length = {config.length} values, got shape {a.shape}"
        )
    return Ring(bits=config.bits).check_residues(a, name="x")


# --------------------------------------------------------------------------- amortized


class PairwiseSeeds:
    """A device's long-term pairwise seeds (amortized variant), agreed once at enrollment.

    Seeds are derived on first use from static X25519 between the device's and the
    peer's enrolled ``agree`` keys (``hazmat.masking.amortized_pair_seed``) and cached. It
    also holds the last round id this device masked for: reusing a round id would reuse
    its masks, so :meth:`claim_round` refuses any id not above it. Persist ``last_round``
    (with the ledger) before the masked upload leaves the device.
    """

    __slots__ = ("_cache", "_identity", "_last_round", "_registry")

    def __init__(
        self, *, identity: DeviceIdentity, registry: Registry, last_round: int | None = None
    ) -> None:
        self._identity = identity
        self._registry = registry
        self._cache: dict[str, bytes] = {}
        self._last_round = (
            None if last_round is None else _check_int("last_round", last_round, 0, _ROUND_HI)
        )

    @property
    def last_round(self) -> int | None:
        return self._last_round

    def seed(self, peer: str) -> bytes:
        """The long-term seed shared with ``peer`` (never leaves the device)."""
        if peer not in self._cache:
            enr = self._registry.devices.get(peer)
            if enr is None:
                raise ValueError(f"peer {peer!r} is not enrolled")
            secret = self._identity.agree(enr.agree_key)
            self._cache[peer] = amortized_pair_seed(secret, self._identity.device, peer)
        return self._cache[peer]

    def claim_round(self, round_id: int) -> None:
        """Record ``round_id`` as used; RemoteProtocolError if not above the last one."""
        if self._last_round is not None and round_id <= self._last_round:
            raise RemoteProtocolError(
                f"round id {round_id} is not above the last masked round {self._last_round}: "
                f"reusing a round id would reuse its masks"
            )
        self._last_round = round_id


class AmortizedSecAggClient:
    """A device's side of one round of the amortized variant (zCDP paper Fig. 2).

    ``mask_input(x)`` masks with ``G(seed_uv, round)`` toward every neighbour (the complete
    graph reproduces eq. (7)); ``reveal(request)`` gives this round's seeds toward the
    neighbours the aggregator reports dropped. See :mod:`edge_sdk.secagg` for why its
    dropout story is weaker than :class:`SecAggClient`'s.

    Args:
        identity: this device's long-term keys.
        registry: everyone's public keys.
        config: the round (``amortized`` must be True).
        seeds: the device's :class:`PairwiseSeeds` (persists across rounds).
    """

    def __init__(
        self,
        *,
        identity: DeviceIdentity,
        registry: Registry,
        config: RoundConfig,
        seeds: PairwiseSeeds,
    ) -> None:
        if not config.amortized:
            raise ValueError("config.amortized is False: use SecAggClient")
        me = identity.device
        if me not in config.cohort:
            raise ValueError(f"device {me!r} is not in the round's cohort")
        if registry.devices.get(me) != identity.enrollment():
            raise ValueError(f"device {me!r} is not enrolled with these keys")
        self._id = identity
        self._reg = registry
        self._cfg = config
        self._digest = config.digest()
        self._seeds = seeds
        self._neighbours = config.neighbours(me)
        self._state = ClientState.IDLE
        self._answer: tuple[RevealRequest, RevealResponse] | None = None

    @property
    def device(self) -> str:
        return self._id.device

    @property
    def state(self) -> ClientState:
        return self._state

    def _round_seed(self, peer: str) -> bytes:
        return amortized_round_seed(self._seeds.seed(peer), self._cfg.round_id)

    def mask_input(
        self, x: np.ndarray, *, coordinates: np.ndarray | None = None,
        max_packet: int = DEFAULT_MAX_PACKET,
    ) -> tuple[MaskedPart, ...]:
        """``c_i = p_i + sum_j sign(i, j) G(seed_ij, t)`` (eqs. (7)-(8)), as signed parts.

        Raises:
            LocalProtocolError: called twice.
            RemoteProtocolError: the round id is not above the last one masked for.
        """
        if self._state is not ClientState.IDLE:
            raise LocalProtocolError(f"mask_input() called in state {self._state.value}")
        values = _select(x, coordinates, self._cfg)
        terms = [(mask_sign(self.device, v), self._round_seed(v)) for v in self._neighbours]
        y = mask(values, bits=self._cfg.bits, terms=terms)
        out = _masked_parts(y, self._cfg, self._id, self._digest, max_packet)
        self._seeds.claim_round(self._cfg.round_id)
        self._state = ClientState.MASKED
        return out

    def reveal(self, msg: RevealRequest) -> RevealResponse:
        """Reveal this round's seeds toward the listed dropped neighbours.

        Raises:
            UnmaskRefused: the request names this device, would leave fewer than
                ``threshold`` neighbours masked with it, or differs from one answered.
            RemoteProtocolError: malformed, unsigned, or naming a non-neighbour.
        """
        if not isinstance(msg, RevealRequest):
            raise RemoteProtocolError(f"expected reveal_request, got {type(msg).__name__}")
        if self._state is ClientState.DONE and self._answer is not None:
            self._check(msg)
            if msg == self._answer[0]:
                return self._answer[1]
            raise UnmaskRefused(f"{self.device!r} already answered a different reveal request")
        if self._state is not ClientState.MASKED:
            raise RemoteProtocolError(f"reveal_request not expected in state {self._state.value}")
        self._check(msg)
        if self.device in msg.dropped:
            raise UnmaskRefused(f"reveal request names the recipient {self.device!r} itself")
        strangers = sorted(set(msg.dropped) - set(self._neighbours))
        if strangers:
            raise RemoteProtocolError(f"reveal request names non-neighbours {strangers}")
        left = len(self._neighbours) - len(msg.dropped)
        if left < self._cfg.threshold:
            raise UnmaskRefused(
                f"revealing {len(msg.dropped)} seeds would leave {left} neighbours masked "
                f"with {self.device!r}, below the threshold {self._cfg.threshold}"
            )
        reply = _sign_with(
            RevealResponse(
                round_id=self._cfg.round_id,
                sender=self.device,
                seeds=tuple((v, self._round_seed(v)) for v in msg.dropped),
            ),
            self._id,
            self._digest,
        )
        self._answer = (msg, reply)
        self._state = ClientState.DONE
        return reply  # type: ignore[no-any-return]

    def _check(self, msg: RevealRequest) -> None:
        _check_round(msg, self._cfg)
        if msg.recipient != self.device:
            raise RemoteProtocolError(f"reveal_request is addressed to {msg.recipient!r}")
        self._reg.verify(None, msg.sig, msg.signing_bytes(self._digest), msg.KIND)
