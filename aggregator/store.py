"""Checkpoints of the aggregator's state on disk: atomic writes, checked reads.

A checkpoint file holds one :meth:`aggregator.rounds.RoundMachine.snapshot`::

    offset  size  field
    0       8     magic b"FEDGECK1"
    8       8     payload length, uint64 big-endian
    16      32    SHA-256 of the payload
    48      n     payload (the snapshot bytes)

:meth:`CheckpointStore.save` writes a temporary file next to the target, fsyncs it,
renames it over the target (``os.replace``, atomic on POSIX) and fsyncs the directory,
so after a crash the file is either the old checkpoint or the new one, whole.
:meth:`CheckpointStore.load` refuses anything else with :class:`CheckpointCorrupted`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from aggregator.errors import AggregatorError

__all__ = ["CheckpointCorrupted", "CheckpointStore"]

MAGIC = b"FEDGECK1"
_HEADER = len(MAGIC) + 8 + 32


class CheckpointCorrupted(AggregatorError):
    """The checkpoint file is missing, truncated or does not match its checksum."""


class CheckpointStore:
    """One checkpoint file (``path``); ``save`` is what ``RoundMachine(checkpoint=...)`` takes.

    Args:
        path: the checkpoint file; its directory must exist.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def exists(self) -> bool:
        return self.path.exists()

    def save(self, snapshot: bytes) -> None:
        """Replace the checkpoint with ``snapshot``, atomically and durably."""
        if not isinstance(snapshot, bytes):
            raise ValueError(f"snapshot must be bytes, got {type(snapshot).__name__}")
        blob = (MAGIC + len(snapshot).to_bytes(8, "big") + hashlib.sha256(snapshot).digest()
                + snapshot)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        # the rename itself is durable only once the directory entry is on disk
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(self) -> bytes:
        """The snapshot last saved.

        Raises:
            CheckpointCorrupted: no file, a wrong magic, a truncated or extended file, or a
                checksum mismatch (naming which).
        """
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            raise CheckpointCorrupted(f"{self.path}: no checkpoint file") from None
        except OSError as e:
            raise CheckpointCorrupted(f"{self.path}: unreadable: {e}") from None
        if len(blob) < _HEADER or blob[: len(MAGIC)] != MAGIC:
            raise CheckpointCorrupted(f"{self.path}: not a fedge checkpoint (bad magic or "
                                      f"shorter than its {_HEADER}-byte header)")
        n = int.from_bytes(blob[8:16], "big")
        payload = blob[_HEADER:]
        if len(payload) != n:
            raise CheckpointCorrupted(f"{self.path}: header says {n} payload bytes, the file "
                                      f"holds {len(payload)} (truncated or appended to)")
        if hashlib.sha256(payload).digest() != blob[16:48]:
            raise CheckpointCorrupted(f"{self.path}: checksum mismatch (the payload was "
                                      f"altered)")
        return payload
