"""The bytes both sides agree on: one schema, one envelope, one version (protocol 8).

Modules, lowest first:

* :mod:`~edge_sdk.wire.schema`: the declarative schema (field types, ``@message``), the
  envelope ``{"v", "kind", "round", "from" | "to", ..., "sig"?}``, canonical :func:`encode`,
  :func:`decode` with caps, :func:`peek`, :func:`sign` and :func:`verify`, :class:`WireError`;
* :mod:`~edge_sdk.wire.topics`: topic names and the naming rule, :class:`Publish`, MQTT sizes;
* :mod:`~edge_sdk.wire.messages`: every kind of a round (the table there), secure
  aggregation's included;
* :mod:`~edge_sdk.wire.chunking`: the masked vector in signed parts and back;
  :func:`upload_sizes`, the byte counts of an upload from real encoded messages.

``tests/golden/wire_vectors.json`` pins every kind's encoding. Devices and the aggregator
speak one version: a message of another is refused with a named :class:`WireError`, so
both are upgraded together.

Errors (the whole tree: :mod:`edge_sdk.errors`)::

    errors.RemoteProtocolError
     +-- WireError          bytes from a peer that are not a valid message
          +-- SpoiledUpload a device's signed parts contradict their digest (dropped)
"""

from edge_sdk.wire.chunking import (
    DEFAULT_MAX_PACKET,
    MaskedVector,
    Reassembler,
    SpoiledUpload,
    split_masked,
    upload_sizes,
)
from edge_sdk.wire.messages import (
    ALL_KINDS,
    DEVICE_KINDS,
    DOWN_KINDS,
    MECHANISM_PARAMS,
    MODEL_KINDS,
    SECAGG_DOWN,
    SECAGG_PROTOCOLS,
    SECAGG_UP,
    SITE_KINDS,
    UP_KINDS,
    AdvertiseKeys,
    BinomialParams,
    CheckIn,
    DdgParams,
    Decline,
    DeviceDpParams,
    EncryptedShare,
    ErrorNotice,
    ForwardedShares,
    GatewaySum,
    GaussianParams,
    MaskedPart,
    ModelUpdate,
    NeighbourKeys,
    RevealRequest,
    RevealResponse,
    RoundPlan,
    SecAggDown,
    SecAggUp,
    ShareKeys,
    SiteRound,
    UnmaskRequest,
    UnmaskResponse,
    UpdateNoiseParams,
    WireArray,
    colluder_problem,
)
from edge_sdk.wire.schema import (
    LIMITS,
    PROTOCOL_VERSION,
    SIGNING_LABEL,
    Header,
    Limits,
    Message,
    WireError,
    decode,
    encode,
    peek,
    sign,
    signer_of,
    verify,
)
from edge_sdk.wire.topics import (
    Publish,
    check_name,
    device_down_topic,
    device_up_topic,
    fleet_topic,
    gateway_up_topic,
    model_topic,
    mqtt_publish_size,
    site_job_topic,
    site_model_topic,
    site_round_topic,
    status_topic,
)

__all__ = [
    "ALL_KINDS",
    "DEFAULT_MAX_PACKET",
    "DEVICE_KINDS",
    "DOWN_KINDS",
    "LIMITS",
    "MECHANISM_PARAMS",
    "MODEL_KINDS",
    "PROTOCOL_VERSION",
    "SECAGG_DOWN",
    "SECAGG_UP",
    "SIGNING_LABEL",
    "SITE_KINDS",
    "UP_KINDS",
    "AdvertiseKeys",
    "CheckIn",
    "BinomialParams",
    "DdgParams",
    "DeviceDpParams",
    "Decline",
    "EncryptedShare",
    "ErrorNotice",
    "ForwardedShares",
    "GatewaySum",
    "GaussianParams",
    "Header",
    "Limits",
    "MaskedPart",
    "MaskedVector",
    "Message",
    "ModelUpdate",
    "NeighbourKeys",
    "Publish",
    "Reassembler",
    "RevealRequest",
    "RevealResponse",
    "RoundPlan",
    "SECAGG_PROTOCOLS",
    "SecAggDown",
    "SecAggUp",
    "ShareKeys",
    "SiteRound",
    "SpoiledUpload",
    "UnmaskRequest",
    "UnmaskResponse",
    "UpdateNoiseParams",
    "WireArray",
    "WireError",
    "check_name",
    "colluder_problem",
    "decode",
    "device_down_topic",
    "device_up_topic",
    "encode",
    "fleet_topic",
    "gateway_up_topic",
    "model_topic",
    "mqtt_publish_size",
    "peek",
    "sign",
    "signer_of",
    "site_job_topic",
    "site_model_topic",
    "site_round_topic",
    "split_masked",
    "status_topic",
    "upload_sizes",
    "verify",
]
