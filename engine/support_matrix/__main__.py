"""`python -m onecat.engine.support_matrix --markdown`: print docs/support_matrix.md (generated from the rules)."""
from __future__ import annotations

import argparse
import sys

from onecat.engine.support_matrix.markdown import render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onecat.engine.support_matrix",
                                     description="The engine's support matrix, generated from its rules.")
    parser.add_argument("--markdown", action="store_true", help="print docs/support_matrix.md")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.error("say what to print: --markdown")
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
