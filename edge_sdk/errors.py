"""The device SDK's exceptions: one root, :class:`EdgeError`, so a caller can catch
everything edge_sdk raises on purpose with one clause (httpx's ``_exceptions.py`` style).

The tree (the module that defines each class on the right; the classes here are the ones
more than one module raises)::

    EdgeError
     +-- LocalProtocolError           this endpoint's caller did wrong (a call out of
     |                                order)                                (errors)
     +-- RemoteProtocolError          a peer sent something invalid (malformed, bad
     |    |                           signature, outsider, wrong round or stage); no
     |    |                           state changed                          (errors)
     |    +-- WireError               bytes that are not a valid message     (wire)
     |    |    +-- SpoiledUpload      a device's signed parts contradict their own
     |    |                           digest; its upload is dropped          (wire)
     |    +-- ReplayedMessage         an exact copy of an accepted message   (errors)
     |    +-- UnmaskRefused           the aggregator asked for what this device must
     |                                not reveal                             (errors)
     +-- RoundFailed                  too few devices left to finish; nothing was
     |                                unmasked                               (errors)
     +-- LedgerError                  the privacy ledger                     (ledger)
     |    +-- LedgerCorrupted         missing, unreadable or tampered: do not train
     |    +-- BudgetExhausted         the release would exceed the owner's budget
     +-- ConfigError                  an unusable configuration, key or registry file;
     |                                also a ValueError                      (config)
     +-- DataFileError                an owner's data file that cannot be trained on;
     |                                also a ValueError                      (data)
     +-- TransportError               the message transport failed           (errors)
     |    +-- PacketTooLarge          a publish over the broker's Maximum Packet
     |                                Size                                   (mqtt)
     +-- TrainingDiverged             a non-finite local update, nothing released;
     |                                also an ArithmeticError                (train)
     +-- ConditionalRoundingFailed    no rounding within the norm bound in time; also
     |                                an ArithmeticError                     (ddp)
     +-- UnsupportedLayer             a model layer outside the supported set; also a
     |                                ValueError                             (model)
     +-- UnsupportedEventError        a privacy event an accountant cannot interpret
                                      (no theorem, or no sound restatement); also a
                                      ValueError                   (privacy.events)

The ``ValueError``/``ArithmeticError`` mixins keep callers that caught those working.
Bad arguments to a function (a negative size, a wrong dtype) stay plain ``ValueError`` and
``TypeError``: they are the caller's bug, not a condition to handle. Foreign exceptions
(paho, ssl, sqlite3, msgpack) are translated into this tree at the adapter that meets them.
``tests/test_exported_members.py`` checks that every public exception class of edge_sdk is
in this tree and drawn here.
"""

from __future__ import annotations

__all__ = [
    "EdgeError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "ReplayedMessage",
    "RoundFailed",
    "TransportError",
    "UnmaskRefused",
]


class EdgeError(Exception):
    """Root of the device SDK's errors (see the module docstring's tree)."""


class LocalProtocolError(EdgeError):
    """This endpoint's caller did something the protocol forbids (e.g. a call out of order)."""


class RemoteProtocolError(EdgeError):
    """A peer (device or aggregator) sent something invalid; it was rejected, no state changed."""


class ReplayedMessage(RemoteProtocolError):
    """An exact copy of a message already accepted (a replay, or an MQTT QoS 1 duplicate)."""


class UnmaskRefused(RemoteProtocolError):
    """The aggregator asked this device for a share (or seed) it must not reveal.

    Raised, for example, when one request asks for both the mask-key share and the
    self-mask share of the same owner, or a second, different request follows the first.
    The blame is remote (the request came from the aggregator); the device's state is
    unchanged and it has revealed nothing.
    """


class RoundFailed(EdgeError):
    """Too few devices remain to finish the round; the sum was not (and will not be) unmasked."""


class TransportError(EdgeError):
    """The transport that carries the messages failed (the MQTT adapter's errors)."""
