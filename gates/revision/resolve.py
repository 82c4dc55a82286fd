"""Which engine code each arm of a run executes, resolved before anything is written to the store.

An arm whose contract (or --baseline-ref / --candidate-ref) names `code: {ref}` runs that commit, checked
out as a cached worktree; the other arm runs the working tree of the same checkout, with a hash of its
uncommitted engine changes. Both get ArmSettings.code, so their fingerprints name the code they ran.
"""
from __future__ import annotations

from pathlib import Path

from onecat.gates.contract import ARM_NAMES, ArmSettings, CodeRevision, Contract
from onecat.gates.revision.errors import RevisionError
from onecat.gates.revision.repository import dirty_sha256, repo_root, resolve_commit
from onecat.gates.revision.worktrees import materialize


def pinned_code(repo: Path, ref: str) -> CodeRevision:
    commit = resolve_commit(repo, ref)
    source = materialize(repo, commit)
    return CodeRevision(commit=commit, ref=ref, source=str(source), label=f"{commit[:12]} ({ref})")


def working_tree_code(repo: Path) -> CodeRevision:
    commit = resolve_commit(repo, "HEAD")
    dirty = dirty_sha256(repo)
    changes = f" + uncommitted engine changes {dirty[:12]}" if dirty else ""
    return CodeRevision(commit=commit, dirty_sha256=dirty, source=str(repo),
                        label=f"{commit[:12]}{changes} (working tree)")


def resolve_arm_code(contract: Contract, arms: dict[str, ArmSettings], start: Path
                     ) -> tuple[dict[str, ArmSettings], list[str]]:
    """`arms` with their code resolved (unchanged when no arm pins code), and the problems found, one per
    arm that cannot run (`arm candidate: 'nope' is not a commit in ...`)."""
    if not contract.pins_code:
        return arms, []
    try:
        repo = repo_root(start)
    except RevisionError as exc:
        return arms, [str(exc)]
    resolved, problems = dict(arms), []
    for a in ARM_NAMES:
        spec = getattr(contract.arms, a).code
        try:
            code = pinned_code(repo, spec.ref) if spec is not None else working_tree_code(repo)
        except RevisionError as exc:
            problems.append(f"arm {a}: {exc}")
            continue
        if not (Path(code.source) / "engine").is_dir():
            problems.append(f"arm {a}: {code.label} has no engine/ folder at {code.source}, so it has no onecat "
                            "engine to run; pin a newer revision")
            continue
        resolved[a] = arms[a].model_copy(update={"code": code})
    return resolved, problems
