"""Dangerous primitives: keyed streams and the arithmetic under the secure-aggregation recipes.

Nothing here checks a protocol's rules, binds a round or keeps a key secret for you; a wrong
key, label or reuse breaks privacy silently. Use the recipes built on top
(``edge_sdk.secagg``, ``edge_sdk.compress``, ``edge_sdk.ddp``, ``edge_sdk.csprng``); the name
warns as pyca/cryptography's ``hazmat`` does.

Modules: :mod:`edge_sdk.hazmat.prg` (HKDF-SHA256 key derivation and keyed ChaCha20 streams:
bytes, uint words, rejection sampling, Fisher-Yates), :mod:`edge_sdk.hazmat.ring` (the ring
Z_{2^b}: residue checks, the centered signed reading, the packed byte layout),
:mod:`edge_sdk.hazmat.masking` (the mask PRG, seed derivations, mask sign convention,
mask/unmask), :mod:`edge_sdk.hazmat.shamir` (Shamir sharing and the share encoding),
:mod:`edge_sdk.hazmat.graph` (the SecAgg+ neighbour graph and the survivor rules).
"""

__all__: list[str] = []
