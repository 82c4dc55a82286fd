"""The entry point of a tensor-parallel worker rank's process: `python -m onecat.engine.parallel.rank_main FD RANK`,
started by rank 0 (rank_process.py says why not multiprocessing). FD is this end of the socket pair to rank 0."""
from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection


def main(argv: list[str]) -> None:
    """Serve the rank; whatever goes wrong, even importing onecat, goes back to rank 0 as text."""
    conn = Connection(int(argv[1]))
    try:
        from onecat.engine.parallel.runtime import serve_rank
    except BaseException as e:  # noqa: BLE001 - rank 0 must learn why this rank never started
        conn.send(("error", f"rank {argv[2]}: could not import onecat: {type(e).__name__}: {e}\n"
                            f"{traceback.format_exc()}"))
        raise SystemExit(1) from None
    serve_rank(conn)


if __name__ == "__main__":
    main(sys.argv)
