"""A stand-in for `onecat gate run` that holds the results store open for writing, for store tests.

    python store_writer.py DB CONTRACT RUN_ID [--existing] [--units N] [--status S] [--checkpoint-every K]
                                              [--seconds S]

Creates RUN_ID (status running), finishes N units, sets status S, prints "ready", then keeps adding rows
(a CHECKPOINT every K rows when K > 0, so the database file itself changes too) until killed or
S seconds have passed. It never closes the store cleanly unless S runs out.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gate_fakes  # noqa: E402,F401 - registers the fake engine the contract names
from onecat.gates.contract import load_contract  # noqa: E402
from onecat.gates.gate_run import gate_run_record  # noqa: E402
from onecat.results.records import RequestRecord  # noqa: E402
from onecat.results.store import Store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("db")
    ap.add_argument("contract")
    ap.add_argument("run_id")
    ap.add_argument("--units", type=int, default=0)
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--existing", action="store_true", help="RUN_ID is already in the store")
    ap.add_argument("--status", default=None, help="set this status after the units")
    args = ap.parse_args()

    contract = load_contract(args.contract)
    store = Store(args.db)
    if not args.existing:
        arms = {a: contract.arm(a) for a in ("baseline", "candidate")}
        store.create_run(gate_run_record(args.run_id, contract, args.contract, arms, {}, "e", "h", "0"))
    for u in range(args.units):
        store.finish_unit(args.run_id, "baseline", "w", f"unit-{u}", u)
    if args.status:
        store.set_status(args.run_id, args.status)
    print("ready", flush=True)
    deadline = time.time() + args.seconds
    i = 0
    while time.time() < deadline:
        store.add_request(args.run_id, "baseline", "w", RequestRecord(request_key=f"k{i}", token_sha256="t"), "busy")
        i += 1
        if args.checkpoint_every and i % args.checkpoint_every == 0:
            store.con.execute("CHECKPOINT")
        time.sleep(0.005)
    store.close()


if __name__ == "__main__":
    main()
