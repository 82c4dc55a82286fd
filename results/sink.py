"""RunSink: where a runner's rows for one (run, arm, workload, unit) go; every call commits before it returns.

A failed request (records.is_failed_request) is stored with its error, but a task outcome derived
from it is dropped: a failed request is never task evidence (its row is what gates and reports see).
"""
from __future__ import annotations

from typing import Callable, Optional

from onecat.results.records import ItemOutcome, Metric, RequestRecord, is_failed_request
from onecat.results.store import Store


class RunSink:
    def __init__(self, store: Store, run_id: str, arm: str, workload_id: str, unit_key: str, position: int,
                 advance: Callable[[int], None] = lambda n: None):
        self.store, self.run_id, self.arm, self.workload_id = store, run_id, arm, workload_id
        self.unit_key, self.position, self._advance = unit_key, position, advance
        self._done: Optional[set[str]] = None
        self._failed: set[str] = set()

    def is_done(self, request_key: str) -> bool:
        """Stored already (by a run that was cut short): `--resume` does not redo it."""
        if self._done is None:
            self._done = self.store.request_keys(self.run_id, self.arm, self.workload_id)
        return request_key in self._done

    def request(self, record: RequestRecord) -> None:
        self.store.add_request(self.run_id, self.arm, self.workload_id, record, self.unit_key)
        if self._done is not None:
            self._done.add(record.request_key)
        if is_failed_request(record):
            self._failed.add(record.request_key)

    def item(self, outcome: ItemOutcome, request_key: Optional[str] = None) -> None:
        """Stores the outcome unless its request failed."""
        if request_key is not None and request_key in self._failed:
            return
        self.store.add_item(self.run_id, self.arm, self.workload_id, outcome, request_key)

    def metric(self, metric: Metric) -> None:
        self.store.add_metric(self.run_id, self.arm, self.workload_id, metric, self.unit_key, self.position)

    def advance(self, n: int = 1) -> None:
        self._advance(n)
