"""Checks that a file can be a whole DuckDB results store, before anything reads or writes it.

Two cheap checks catch what DuckDB would otherwise report as a traceback, or not at all:
- the header, before DuckDB opens the file: an empty file, a text file, an SQLite file, random bytes.
  (DuckDB would also try to download an extension for an SQLite file, so it must not see one.)
- the extent, right after it opens: every block the tables point at must lie inside the file. A file cut
  short can otherwise open fine and fail only when a query reaches the missing part, or be written to.
Damage inside a block (bad checksum) is found by DuckDB when it reads that block; errors.as_store_error
turns it into a clear message.
"""
from __future__ import annotations

import os
from pathlib import Path

from onecat.results.errors import StoreCorrupt

HEADER_BYTES = 3 * 4096  # DuckDB's main header and its two alternating database headers
MAGIC_OFFSET, MAGIC = 8, b"DUCK"


def check_header(path: str | Path) -> None:
    """Raise StoreCorrupt when the existing file at `path` is not a DuckDB database file."""
    p = Path(path)
    if not os.path.lexists(p):
        return
    if p.is_dir():
        raise StoreCorrupt(p, "is a folder, not a DuckDB database file")
    size = p.stat().st_size
    if size == 0:
        raise StoreCorrupt(p, "is empty (0 bytes), not a DuckDB database")
    with open(p, "rb") as fh:
        head = fh.read(HEADER_BYTES)
    if head.startswith(b"SQLite format 3\0"):
        raise StoreCorrupt(p, "is an SQLite database, not a DuckDB one")
    if head[MAGIC_OFFSET:MAGIC_OFFSET + len(MAGIC)] != MAGIC:
        raise StoreCorrupt(p, f"is not a DuckDB database (it starts with {head[:16]!r})")
    if size < HEADER_BYTES:
        raise StoreCorrupt(p, f"is truncated: {size} bytes, shorter than DuckDB's {HEADER_BYTES}-byte header")


def check_extent(con, path: str | Path) -> None:
    """Raise StoreCorrupt when a table of the open database `con` points past the end of its file."""
    size = Path(path).stat().st_size
    (block_size,) = con.execute("SELECT block_size FROM pragma_database_size()"
                                " WHERE database_name = current_database()").fetchone()
    tables = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE database_name ="
                                        " current_database() AND schema_name = 'main' AND NOT temporary").fetchall()]
    last = -1
    for table in tables:
        source = "pragma_storage_info('" + table.replace("'", "''") + "')"
        columns = {d[0] for d in con.execute(f"SELECT * FROM {source} LIMIT 0").description}
        extra = "coalesce(list_max(additional_block_ids), -1)" if "additional_block_ids" in columns else "-1"
        persistent = "WHERE persistent" if "persistent" in columns else ""
        (high,) = con.execute(f"SELECT max(greatest(block_id, {extra})) FROM {source} {persistent}").fetchone()
        last = max(last, -1 if high is None else int(high))
    needed = HEADER_BYTES + (last + 1) * int(block_size)
    if last >= 0 and size < needed:
        raise StoreCorrupt(path, f"is truncated: {size:,} bytes, but its tables use {needed:,} bytes")
