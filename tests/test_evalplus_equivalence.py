"""onecat's EvalPlus evaluator against EvalPlus's own (evalplus 0.3.1, `untrusted_check` and
`trusted_exec` from the package, pointed at the shared HumanEval+ / MBPP+ files): base and plus
verdicts agree on every sample of a fixed set — canonical solutions, wrong answers, solutions that
raise, loop forever, return an equal value of another type (Counter for dict, 2.0 for 2, tuple vs list),
import numpy — over HumanEval+ and MBPP+ tasks that include special oracles and float tolerance.

Known EvalPlus disagreements, excluded with the reason:
- HumanEval/32 (find_zero): EvalPlus 0.3.1 compares the root against the canonical root with `==`
  before its special oracle and fails every solution, the canonical one included; onecat applies the
  oracle (|poly(x)| <= atol), as EvalPlus intends.

Slow (EvalPlus runs every plus input of every sample in its own processes); run with -m slow.
"""
from __future__ import annotations

import pytest

from tests.test_evalplus import HE_FILE, MBPP_FILE, needs_data

evalplus_eval = pytest.importorskip("evalplus.eval", reason="evalplus is needed for the equivalence test")

KNOWN_EVALPLUS_BUGS = {"HumanEval/32": "find_zero: EvalPlus 0.3.1 fails every solution, the canonical one too"}
HE_TASKS = ["HumanEval/0", "HumanEval/2", "HumanEval/32", "HumanEval/4", "HumanEval/10", "HumanEval/12", "HumanEval/20",
            "HumanEval/38", "HumanEval/53", "HumanEval/87", "HumanEval/100", "HumanEval/111", "HumanEval/120",
            "HumanEval/130", "HumanEval/148", "HumanEval/163"]
MBPP_TASKS = ["Mbpp/2", "Mbpp/124", "Mbpp/252", "Mbpp/558", "Mbpp/581", "Mbpp/722", "Mbpp/737", "Mbpp/769",
              "Mbpp/786", "Mbpp/787"]


def _body(problem, lines: list[str]) -> str:
    """A solution: the prompt's signature (HumanEval) or a fresh def (MBPP) with this body."""
    indent = "    "
    if problem.dataset == "humaneval":
        return problem.prompt + "".join(indent + line + "\n" for line in lines)
    import re

    sig = re.search(rf"def {re.escape(problem.entry_point)}\([^)]*\)", problem.canonical_solution)
    return f"{sig.group(0)}:\n" + "".join(indent + line + "\n" for line in lines)


def _wrap_canonical(problem, transform: str) -> str:
    """The canonical solution renamed, behind a wrapper that transforms its result."""
    ref = problem.reference_code.replace(f"def {problem.entry_point}(", f"def _canonical_{problem.entry_point}(")
    return (ref + f"\n\ndef {problem.entry_point}(*args):\n"
            f"    result = _canonical_{problem.entry_point}(*args)\n    {transform}\n")


def samples(problem) -> dict[str, str]:
    return {
        "canonical": problem.reference_code,
        "returns_none": _body(problem, ["return None"]),
        "raises": _body(problem, ["raise ValueError('no')"]),
        "loops": _body(problem, ["while True:", "    pass"]),
        "plain_types": _wrap_canonical(problem, "return result"),
        "counter_for_dict": _wrap_canonical(problem, "import collections\n    return collections.Counter(result) "
                                                     "if type(result) is dict else result"),
        "float_for_int": _wrap_canonical(problem, "return float(result) if type(result) is int else result"),
        "tuple_for_list": _wrap_canonical(problem, "return tuple(result) if type(result) is list else result"),
        "numpy": _wrap_canonical(problem, "import numpy as np\n    return result if np.ndim(0) == 0 else None"),
        "off_by_one": _wrap_canonical(problem, "return result + 1 if type(result) is int else result"),
    }


def _evalplus_verdict(problem, code: str, oracle: dict) -> tuple[bool, bool]:
    out = {}
    for name in ("base", "plus"):
        status, _ = evalplus_eval.untrusted_check(problem.dataset, code, getattr(problem, f"{name}_input"),
                                                  problem.entry_point, expected=oracle[name], atol=problem.atol,
                                                  ref_time=oracle[f"{name}_time"], fast_check=True)
        out[name] = status == evalplus_eval.PASS
    return out["base"], out["base"] and out["plus"]


@pytest.mark.slow
@needs_data
def test_onecat_and_evalplus_agree_sample_for_sample(tmp_path):
    from evalplus.eval._special_oracle import MBPP_OUTPUT_NOT_NONE_TASKS
    from evalplus.gen.util import trusted_exec

    from onecat.gates.tasks.evalplus import ReferenceCache, check_solution
    from onecat.gates.tasks.evalplus_data import load_problems

    chosen = [p for p in load_problems(HE_FILE, "humaneval") if p.task_id in HE_TASKS]
    chosen += [p for p in load_problems(MBPP_FILE, "mbpp") if p.task_id in MBPP_TASKS]
    caches = {d: ReferenceCache(f"{d}-equiv", tmp_path) for d in ("humaneval", "mbpp")}
    disagreements, known, total = [], [], 0
    for problem in chosen:
        oracle = {}
        for name in ("base", "plus"):
            oracle[name], oracle[f"{name}_time"] = trusted_exec(
                problem.reference_code, getattr(problem, f"{name}_input"), problem.entry_point, record_time=True,
                output_not_none=problem.entry_point in MBPP_OUTPUT_NOT_NONE_TASKS)
        reference = caches[problem.dataset].get(problem)
        for kind, code in samples(problem).items():
            total += 1
            theirs = _evalplus_verdict(problem, code, oracle)
            outcome = check_solution(problem, code, reference)
            ours = (outcome.base_pass, outcome.base_pass and outcome.plus_pass)
            if ours != theirs and problem.task_id in KNOWN_EVALPLUS_BUGS:
                known.append((problem.task_id, kind, ours, theirs))
            elif ours != theirs:
                disagreements.append((problem.task_id, kind, {"onecat": ours, "evalplus": theirs,
                                                               "why": outcome.failure_reason, "detail": outcome.detail}))
    assert total == 10 * len(chosen) and len(chosen) == len(HE_TASKS) + len(MBPP_TASKS)
    assert not disagreements, disagreements
    # the known bug shows as documented: EvalPlus fails the canonical find_zero, onecat passes it
    assert ("HumanEval/32", "canonical", (True, True), (False, False)) in known, known
