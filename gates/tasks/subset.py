"""Which items of a task dataset a workload uses: first N, explicit ids, or a seeded sample.

Declared in the contract's workload (`subset: {first: 50}`, `{ids: [...]}`, `{sample: 40, seed: 1}`)
and recorded with the run (the spec plus a hash of the chosen ids), so two runs are comparable only
when they scored the same items.
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable, Optional, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

T = TypeVar("T")


class TaskSubset(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    first: Optional[int] = Field(default=None, ge=1)
    ids: Optional[list[str]] = None
    sample: Optional[int] = Field(default=None, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _one_rule(self) -> "TaskSubset":
        given = [n for n in ("first", "ids", "sample") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"subset: give one of first / ids / sample, not {' and '.join(given)}")
        return self


def select(items: Sequence[T], subset: Optional[BaseModel], item_id: Callable[[T], str]) -> list[T]:
    """Items chosen by `subset` (any model with first/ids[/sample/seed]); dataset order is kept."""
    if subset is None:
        return list(items)
    first, ids = getattr(subset, "first", None), getattr(subset, "ids", None)
    sample = getattr(subset, "sample", None)
    if first is not None:
        return list(items[:first])
    if ids is not None:
        by_id = {item_id(x): x for x in items}
        missing = [i for i in ids if i not in by_id]
        if missing:
            known = ", ".join(list(by_id)[:3])
            raise ValueError(f"subset ids not in the dataset: {missing[:5]} (ids look like: {known}, ...)")
        wanted = set(ids)
        return [x for x in items if item_id(x) in wanted]
    if sample is not None:
        if sample > len(items):
            raise ValueError(f"subset sample {sample} is larger than the dataset ({len(items)} items)")
        chosen = set(random.Random(getattr(subset, "seed", 0)).sample(range(len(items)), sample))
        return [x for i, x in enumerate(items) if i in chosen]
    return list(items)


def subset_record(subset: Optional[BaseModel], chosen_ids: Sequence[str]) -> dict:
    """What to store with the run so the chosen items can be compared and reproduced."""
    return {"subset": subset.model_dump(exclude_none=True) if subset is not None else "all",
            "items": len(chosen_ids),
            "ids_sha256": hashlib.sha256("\n".join(chosen_ids).encode()).hexdigest()}
