"""Arms at code revisions: run an arm's engine from a git revision, judged by the current code.

    resolve_arm_code(contract, arms, start) -> (arms with ArmSettings.code set, problems)   # resolve.py
    materialize(repo, commit) -> worktree path (cached under .onecat/worktrees/<commit>)     # worktrees.py
    EngineWorker                one worker process per arm, over a pipe                      # client.py
    worker.py                   the worker itself: imports the engine from the revision, serves requests

When any arm of a contract pins `code: {ref: ...}` (or --baseline-ref / --candidate-ref), both arms run
through workers (the unpinned arm runs the working tree), so the inter-process cost is the same on both
sides; the runners, checks, statistics and store stay the current revision's.
"""
from onecat.gates.revision.errors import RevisionError  # noqa: F401
