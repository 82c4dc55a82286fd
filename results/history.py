"""A contract's runs across time and revisions: what `onecat results history` shows.

    contract_history(store, contract_name, metrics=None) -> History

One row per run of that contract name, oldest first: its verdict, revisions, each gate's status and
key number (the figure its check judged), and the mean of each chosen metric per (key, arm). With no
metrics chosen, the metrics the contract's gates name (e.g. a speed gate's `decode_tok_s`) are used.
Raises LookupError for a contract name or metric the store does not have, naming what it does have.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from onecat.results.store import Store

UNPOSITIONED = "json_extract(tags_json, '$.position') IS NULL"  # per-draft-position figures are no series
# where a check's stored statistic keeps the number it judged, first match wins
KEY_NUMBER_PATHS = (("estimate",), ("acceptance_length",), ("candidate", "rate"), ("different",),
                    ("candidate", "inconsistent"))


@dataclass
class HistoryRun:
    run_id: str
    started_at: Any
    status: str
    verdict: Optional[str]
    engine_revision: Optional[str]
    harness_revision: Optional[str]
    contract_fingerprint: str
    gates: dict[str, tuple[str, Optional[float]]] = field(default_factory=dict)  # gate id -> (status, key number)
    metrics: dict[tuple[str, str, str], float] = field(default_factory=dict)  # (metric, key, arm) -> mean


@dataclass
class History:
    contract_name: str
    metrics: list[str]
    runs: list[HistoryRun] = field(default_factory=list)

    def gate_ids(self) -> list[str]:
        return list(dict.fromkeys(g for r in self.runs for g in r.gates))

    def series(self) -> list[tuple[str, str, str]]:
        """Every (metric, key, arm) some run has, in a stable order."""
        return sorted({s for r in self.runs for s in r.metrics})


def key_number(statistic: dict) -> Optional[float]:
    for path in KEY_NUMBER_PATHS:
        value: Any = statistic
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    measures = [v.get("diff") for v in statistic.values() if isinstance(v, dict) and "diff" in v]  # task_score
    return float(measures[0]) if measures and measures[0] is not None else None


def _contract_names(store: Store) -> list[str]:
    _, rows = store.query("SELECT DISTINCT contract_name FROM runs ORDER BY 1")
    return [r[0] for r in rows]


def _gate_metrics(store: Store, run_ids: list[str]) -> list[str]:
    _, rows = store.query("SELECT config_json FROM checks WHERE list_contains(?, run_id)", [run_ids])
    named = [json.loads(r[0] or "{}").get("metric") for r in rows]
    return list(dict.fromkeys(m for m in named if m))


def contract_history(store: Store, contract_name: str, metrics: Optional[list[str]] = None) -> History:
    columns, found = store.query(
        "SELECT run_id, started_at, status, verdict, engine_revision, harness_revision, contract_fingerprint"
        " FROM runs WHERE contract_name = ? ORDER BY started_at, run_id", [contract_name])
    runs = [dict(zip(columns, row)) for row in found]
    if not runs:
        known = _contract_names(store)
        raise LookupError(f"no runs of contract {contract_name!r} in {store.path}; it has runs of: "
                          + (", ".join(known) if known else "nothing yet") + " (`onecat results list` shows them)")
    run_ids = [r["run_id"] for r in runs]
    _, rows = store.query(f"SELECT DISTINCT name FROM metrics WHERE list_contains(?, run_id) AND {UNPOSITIONED}"
                          " ORDER BY 1", [run_ids])
    stored = [r[0] for r in rows]
    unknown = [m for m in metrics or [] if m not in stored]
    if unknown:
        raise LookupError(f"no metric {', '.join(map(repr, unknown))} in the runs of {contract_name!r}; "
                          f"they store: {', '.join(stored) or 'no metrics'}")
    chosen = list(metrics) if metrics else [m for m in _gate_metrics(store, run_ids) if m in stored]
    history = History(contract_name, chosen)
    by_id: dict[str, HistoryRun] = {}
    for r in runs:
        by_id[r["run_id"]] = HistoryRun(**r)
        history.runs.append(by_id[r["run_id"]])
    _, checks = store.query("SELECT run_id, gate_id, status, statistic_json FROM checks WHERE list_contains(?, run_id)"
                            " ORDER BY run_id, gate_index", [run_ids])
    for run_id, gate_id, status, statistic in checks:
        by_id[run_id].gates[gate_id] = (status, key_number(json.loads(statistic or "{}")))
    if chosen:
        _, means = store.query("SELECT run_id, name, key, arm, avg(value) FROM metrics WHERE list_contains(?, run_id)"
                               f" AND list_contains(?, name) AND {UNPOSITIONED} GROUP BY ALL", [run_ids, chosen])
        for run_id, name, key, arm, mean in means:
            by_id[run_id].metrics[(name, key or "", arm)] = float(mean)
    return history
