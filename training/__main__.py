"""`python -m onecat.training TARGET DATA OUT [OPTIONS_JSON]`: train_drafter without the CLI's dependencies.

For machines that have the engine's packages but not typer/rich (the `onecat drafter train` command
needs them). OPTIONS_JSON holds TrainOptions fields, e.g. '{"device": "cuda", "time_budget_s": 470}'.
Prints the result as JSON; exit 2 on bad options, 4 on a failed or interrupted run.
"""
from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    from onecat.engine.errors import ConfigError, EngineError
    from onecat.training.api import sigterm_interrupts, train_drafter

    try:
        options = json.loads(argv[3]) if len(argv) == 4 else {}
    except json.JSONDecodeError as exc:
        print(f"error: OPTIONS_JSON is not JSON ({exc})", file=sys.stderr)
        return 2
    try:
        with sigterm_interrupts():
            result = train_drafter(argv[0], argv[1], argv[2], **options)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (EngineError, RuntimeError, OSError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 4
    print(json.dumps({"out": str(result.out_dir), "steps": result.steps, "stopped_by": result.stopped_by,
                      "weights_bytes": result.weights_bytes, "final_eval": result.final_eval,
                      "phase_seconds": result.phase_seconds}, indent=2), flush=True)
    return 4 if result.stopped_by == "interrupted" else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
