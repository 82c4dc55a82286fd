"""Does an installed peer answer? Starts it as `onecat bench compare contracts/peers_cpu.yaml` would (the first
engine of that file with the backend), asks for one short greedy completion on the file's model (the embedded
SmolLM2), and stops it. scripts/setup_peers.sh runs it after each build.

    .venv/bin/python scripts/check_peer.py llama_server      # or llama_cpp_serve, vllm_serve

Exit 0 when it answered (printing the answer and the instruction sets it used), 1 when it did not: FAILED with
its exit cause ("killed by SIGSEGV (-11) before it was ready") and its last output; 2 on a bad argument.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"


def check(backend: str, spec_path: Path) -> int:
    from onecat.engine import SamplingParams
    from onecat.gates.compare import engine_arm, load_compare
    from onecat.gates.engine_failure import died, failure_text, output_tail
    from onecat.gates.engines.base import EngineDiedError, open_engine
    from onecat.gates.registry import ENGINES, load_plugins

    load_plugins()
    spec = load_compare(spec_path)
    labels = [label for label, engine in spec.engines.items() if engine.backend == backend]
    if not labels:
        print(f"error: {spec_path} has no engine with backend {backend}; its backends: "
              f"{', '.join(sorted({e.backend for e in spec.engines.values()}))}", file=sys.stderr)
        return 2
    arm = engine_arm(spec, labels[0])
    problems = ENGINES[backend].check(arm)
    if problems:
        print(f"{backend}: FAILED: cannot start: {'; '.join(problems)}", file=sys.stderr)
        return 1
    try:
        engine = open_engine(arm, spec.seeds[0])
    except EngineDiedError as exc:
        print(f"{backend}: FAILED: {failure_text(exc.failure)}", file=sys.stderr)
        return 1
    try:
        out = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))[0]
        failure = died(engine, 2.0) if out.error or not out.text else None
        tail = output_tail(engine)
        info = engine.info()
    finally:
        engine.close()
    if failure or out.error or not out.text:
        why = failure_text(failure) if failure else (f"its answer to {PROMPT!r} was "
                                                      f"{out.error or 'empty'}\nlast output:\n{tail}")
        print(f"{backend}: FAILED: {why}", file=sys.stderr)
        return 1
    print(f"{backend}: answered {PROMPT!r} with {out.text!r}; instruction sets used: "
          f"{info.get('isa_used') or 'not reported'}; built: {info.get('peer_build') or 'not by setup_peers.sh'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backend", choices=["llama_cpp_serve", "llama_server", "vllm_serve"])
    parser.add_argument("--spec", type=Path, default=ROOT / "contracts" / "peers_cpu.yaml",
                        help="comparison file whose engine settings the peer starts with")
    args = parser.parse_args(argv)
    return check(args.backend, args.spec)


if __name__ == "__main__":
    sys.exit(main())
