"""The ledger file's page auditor: every byte of the sqlite main file is either checked by
sqlite's structure check, covered by one of the ledger's hashes, a fixed header value, or
unused space, which ``secure_delete`` keeps zero (:mod:`edge_sdk.ledger.store` runs it when
it opens or verifies a ledger).

sqlite's integrity_check verifies the b-tree structure (page types, cell bounds, key order,
free-space accounting, every page used once) and the ledger's hashes cover every value. What
neither sees is space sqlite considers unused and header fields it ignores. With
secure_delete every freed byte is zeroed and new pages start zeroed, and an append-only
table grows its leaves by adding fresh pages, so in a healthy ledger the unused bytes of
leaf, overflow and free pages are zero and the header holds what creation wrote. Interior
pages are the exception: splitting one leaves stale cell pointers in its unused gap (seen
past ~9,000 entries), so their unused space is not checked — a false alarm would
stop a healthy device for good. Format: https://www.sqlite.org/fileformat2.html.

Pure reading: nothing here writes, and nothing here knows the ledger's schema; the caller
passes the values its creation wrote (root pages, schema cookie, user_version,
application_id). Every problem is a :class:`~edge_sdk.ledger.accounting.LedgerCorrupted`.
"""

from __future__ import annotations

import struct
from pathlib import Path

from edge_sdk.ledger.accounting import LedgerCorrupted

__all__ = ["check_file", "check_header"]

_MAGIC = b"SQLite format 3\x00"
# Header fields that never change after creation: offset -> (size, expected value); the
# caller adds user_version (offset 60) and application_id (offset 68).
_FIXED = {18: (1, 2), 19: (1, 2), 20: (1, 0), 21: (1, 64), 22: (1, 32), 23: (1, 32),
          44: (4, 4), 48: (4, 0), 52: (4, 0), 56: (4, 1), 64: (4, 0)}


def check_header(path: Path) -> None:
    """Before sqlite touches the file: it is missing or empty (an interrupted creation), or
    a sqlite file in WAL mode (creation switches to WAL before anything else).

    Raises:
        LedgerCorrupted: unreadable, not a sqlite file, or not in WAL mode.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(100)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise LedgerCorrupted(f"{path}: cannot read the file ({exc})") from exc
    if not head:
        return
    if len(head) < 100 or head[:16] != _MAGIC:
        raise LedgerCorrupted(f"{path}: not a sqlite database (bad or truncated header)")
    if head[18:20] != b"\x02\x02":  # creation switches to WAL before anything else
        raise LedgerCorrupted(f"{path}: header bytes 18-19 are {head[18:20].hex()}, expected "
                              "0202 (WAL)")


def _u16(b: bytes, i: int) -> int:
    return int(struct.unpack_from(">H", b, i)[0])


def _u32(b: bytes, i: int) -> int:
    return int(struct.unpack_from(">I", b, i)[0])


def _varint(b: bytes, i: int) -> tuple[int, int]:
    v = 0
    for k in range(8):
        byte = b[i + k]
        v = (v << 7) | (byte & 0x7F)
        if byte < 0x80:
            return v, i + k + 1
    return (v << 8) | b[i + 8], i + 9


class _Bad(Exception):
    pass


def _zero(b: bytes, start: int, end: int, what: str) -> None:
    if start > end:
        raise _Bad(f"{what}: overlapping regions at offset {end}")
    if b[start:end] != bytes(end - start):
        nz = next(i for i in range(start, end) if b[i])
        raise _Bad(f"{what}: unused byte at offset {nz} is {b[nz]:#04x}, expected 0")


def check_file(path: Path, *, roots: list[int], cookie: int, user_version: int,
               application_id: int) -> None:
    """Audit the main file byte by byte (call it only when the WAL is empty, so that the main
    file alone holds the database and cannot move under the read).

    Args:
        path: the sqlite main file.
        roots: the root pages of its tables, as creation recorded them.
        cookie: the schema cookie creation recorded.
        user_version: the header's user_version (the ledger's schema version).
        application_id: the header's application_id.

    Raises:
        LedgerCorrupted: unreadable, or naming the first byte or field out of place.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LedgerCorrupted(f"{path}: cannot read the file ({exc})") from exc
    fixed = {**_FIXED, 60: (4, user_version), 68: (4, application_id)}
    try:
        _check_pages(data, roots, cookie, fixed)
    except _Bad as exc:
        raise LedgerCorrupted(f"{path}: {exc}") from None
    except (struct.error, IndexError, ValueError) as exc:
        raise LedgerCorrupted(f"{path}: malformed page structure ({exc})") from None


def _check_pages(data: bytes, roots: list[int], cookie: int,
                 fixed: dict[int, tuple[int, int]]) -> None:
    if len(data) < 512 or data[:16] != _MAGIC:
        raise _Bad("not a sqlite file")
    ps = _u16(data, 16)
    ps = 65536 if ps == 1 else ps
    if ps < 512 or ps & (ps - 1) or len(data) % ps:
        raise _Bad(f"page size {ps} does not fit the file size {len(data)}")
    npages = len(data) // ps
    for off, (size, want) in sorted(fixed.items()):
        got = int.from_bytes(data[off:off + size], "big")
        if got != want:
            raise _Bad(f"file header field at offset {off} is {got}, expected {want}")
    _zero(data, 72, 92, "file header (reserved)")
    if _u32(data, 24) != _u32(data, 92):
        raise _Bad("file header: change counter and version-valid-for differ")
    if _u32(data, 28) != npages:
        raise _Bad(f"file header says {_u32(data, 28)} pages, the file has {npages}")
    if _u32(data, 40) != cookie:
        raise _Bad(f"file header: schema cookie {_u32(data, 40)}, expected {cookie}")
    if not 3_000_000 <= _u32(data, 96) < 4_000_000:
        raise _Bad(f"file header: sqlite version number {_u32(data, 96)} is not a SQLite 3")
    seen: set[int] = set()

    def page(pgno: int) -> bytes:
        if not 1 <= pgno <= npages or pgno in seen:
            raise _Bad(f"page {pgno} is out of range or referenced twice")
        seen.add(pgno)
        return data[(pgno - 1) * ps: pgno * ps]

    overflows: list[tuple[int, int]] = []
    stack = sorted(set(roots) | {1})
    while stack:
        pgno = stack.pop()
        overflows += _check_btree_page(page(pgno), pgno, ps, stack)
    for first, remaining in overflows:  # chains of payload that did not fit in a cell
        pgno = first
        while True:
            buf = page(pgno)
            if remaining <= ps - 4:
                if _u32(buf, 0):
                    raise _Bad(f"page {pgno}: overflow chain goes on past its payload")
                _zero(buf, 4 + remaining, ps, f"page {pgno} (overflow)")
                break
            remaining -= ps - 4
            pgno = _u32(buf, 0)
    trunk, free = _u32(data, 32), _u32(data, 36)
    while trunk:
        buf = page(trunk)
        n = _u32(buf, 4)
        leaves = [_u32(buf, 8 + 4 * k) for k in range(n)]
        _zero(buf, 8 + 4 * n, ps, f"page {trunk} (freelist trunk)")
        for leaf in leaves:
            _zero(page(leaf), 0, ps, f"page {leaf} (free)")
        free -= 1 + n
        trunk = _u32(buf, 0)
    if free != 0 or len(seen) != npages:
        raise _Bad(f"{npages - len(seen)} pages are neither in a b-tree nor free")


def _check_btree_page(buf: bytes, pgno: int, ps: int, stack: list[int]) -> list[tuple[int, int]]:
    """Leaf pages: zero outside the header, cell pointers, cells and freeblock headers.
    Interior pages: children pushed, unused space not checked (stale after a split).
    Returns the overflow chains (first page, bytes left) of the page's cells."""
    h = 100 if pgno == 1 else 0
    kind = buf[h]
    if kind not in (2, 5, 10, 13):
        raise _Bad(f"page {pgno}: unknown b-tree page type {kind}")
    interior, table = kind in (2, 5), kind in (5, 13)
    hdr = 12 if interior else 8
    ncell, content = _u16(buf, h + 3), _u16(buf, h + 5) or 65536
    ptrs = h + hdr + 2 * ncell
    if not ptrs <= content <= ps:
        raise _Bad(f"page {pgno}: cell area starts at {content}, pointers end at {ptrs}")
    zero = _zero if not interior else lambda *_: None
    zero(buf, ptrs, content, f"page {pgno} (unallocated)")
    if interior:
        stack.append(_u32(buf, h + 8))
    # Payload kept on the page before spilling to overflow pages (fileformat2, section 1.6).
    max_local = ps - 35 if table else (ps - 12) * 64 // 255 - 23
    min_local = (ps - 12) * 32 // 255 - 23
    spans, overflows = [], []
    for k in range(ncell):
        start = _u16(buf, h + hdr + 2 * k)
        i = start
        if interior:
            stack.append(_u32(buf, i))
            i += 4
        if kind == 5:  # table interior: child pointer and key only
            _, i = _varint(buf, i)
            spans.append((start, i))
            continue
        size, i = _varint(buf, i)
        if kind == 13:
            _, i = _varint(buf, i)  # rowid
        local = size
        if size > max_local:
            local = min_local + (size - min_local) % (ps - 4)
            local = local if local <= max_local else min_local
            overflows.append((_u32(buf, i + local), size - local))
            i += 4
        spans.append((start, i + local))
    block = _u16(buf, h + 1)
    while block:
        nxt, size = _u16(buf, block), _u16(buf, block + 2)
        spans.append((block, block + 4))
        zero(buf, block + 4, block + size, f"page {pgno} (freeblock)")
        if nxt and nxt <= block:
            raise _Bad(f"page {pgno}: freeblocks out of order")
        block = nxt
    pos = content
    for a, b in sorted(spans):
        zero(buf, pos, a, f"page {pgno} (fragment)")
        pos = max(pos, b)
    zero(buf, pos, ps, f"page {pgno} (tail)")
    return overflows
