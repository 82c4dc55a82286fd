"""Requests a contract makes impossible by its own numbers, found before anything is loaded.

An engine refuses a prompt that does not fit its context and stops a generation at the context's
end, so a workload whose prompt + output cannot fit an arm's `max_model_len` would run, fail or
come back short, and be judged on that. `gate run` and `contract check` (both through `load_feasible_contract`) refuse such a contract
with the numbers that collide and the fix.
"""
from __future__ import annotations

from pathlib import Path

from onecat.gates import registry
from onecat.gates.contract.errors import ContractError, ContractIssue
from onecat.gates.contract.load import load_contract
from onecat.gates.contract.model import ARM_NAMES, Contract


def impossible_requests(contract: Contract) -> list[ContractIssue]:
    registry.load_plugins()
    issues = []
    for w in contract.workloads:
        runner_cls = registry.RUNNERS.get(w.kind)
        if runner_cls is None:
            continue  # preflight names runners that are not installed
        need = runner_cls().min_request_tokens(w, contract.sampling)
        for arm_name in ARM_NAMES:
            limit = contract.arm(arm_name).engine.max_model_len
            if limit is not None and need > limit:
                issues.append(ContractIssue(
                    path=f"arms.{arm_name}.engine.max_model_len",
                    message=f"workload {w.id!r} needs requests of at least {need} tokens (prompt + output) but "
                            f"the {arm_name} arm's max_model_len is {limit}: every request would be refused or cut "
                            f"short; raise max_model_len to >= {need} or shorten the workload"))
    return issues


def load_feasible_contract(path: str | Path) -> Contract:
    """The validated contract, or ContractError (exit 2) when it is invalid or its requests cannot fit."""
    contract = load_contract(path)
    impossible = impossible_requests(contract)
    if impossible:
        raise ContractError(str(path), impossible)
    return contract
