"""`gate run --junit FILE`: a run's gates as JUnit XML, for CI systems that read test reports.

    <testsuites name="onecat gate" tests= failures= errors= skipped= time=>
      <testsuite name=CONTRACT tests= failures= errors= skipped= time= timestamp= hostname= id=>
        <properties> verdict, verdict_reason, run_id, contract_fingerprint, arm fingerprints, revisions
        <testcase name=GATE_ID classname=CONTRACT>          one per gate, in contract order
          <failure message= type="gate-fail">   a binding gate that failed (its result says why)
          <skipped message=>                     INCONCLUSIVE, or an informative gate that did not pass
          <system-out>                           the gate's summary and statistic
        <system-out>                             the verdict and one line per gate

The XML is rendered from the store only, so any stored run can be written again. A run's verdict is its
exit code; the XML shows the same evidence gate by gate (an INCONCLUSIVE run has skipped cases and no
failure).
"""
from __future__ import annotations

import datetime as dt
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from onecat.results.store import Store

SUITES_NAME = "onecat gate"


def _case(contract: str, check: dict) -> tuple[ET.Element, str]:
    """A gate's testcase and its outcome: passed, failure or skipped."""
    case = ET.Element("testcase", name=check["gate_id"], classname=contract)
    status, summary = check["status"], check["summary"] or ""
    binding = not check["informative"]
    if status == "fail" and binding:
        ET.SubElement(case, "failure", message=summary, type="gate-fail").text = \
            f"gate {check['gate_id']} ({check['check_name']}) failed: {summary}"
        outcome = "failure"
    elif status == "inconclusive" or (status == "fail" and not binding):
        why = "INCONCLUSIVE" if status == "inconclusive" else "informative gate FAIL (does not change the verdict)"
        ET.SubElement(case, "skipped", message=f"{why}: {summary}")
        outcome = "skipped"
    else:
        outcome = "passed"
    statistic = json.loads(check["statistic_json"] or "{}")
    ET.SubElement(case, "system-out").text = f"{status.upper()}: {summary}\nstatistic: {json.dumps(statistic)}"
    return case, outcome


def junit_tree(store: Store, run_id: str) -> ET.ElementTree:
    """The JUnit XML of one stored gate run."""
    run = store.run(run_id)
    if run is None:
        raise LookupError(f"no run {run_id!r} in {store.path}")
    if run.get("kind") not in (None, "gate"):
        raise ValueError(f"run {run_id} is a {run['kind']} run; JUnit XML describes a gate run's gates")
    verdict = store.verdict(run_id) or {"verdict": "(none)", "reason": f"run status {run['status']}"}
    contract = run["contract_name"]
    cases, counts = [], {"failure": 0, "skipped": 0, "passed": 0}
    for check in store.checks(run_id):
        case, outcome = _case(contract, check)
        cases.append(case)
        counts[outcome] += 1
    started, finished = run["started_at"], run["finished_at"]
    wall = (finished - started).total_seconds() if isinstance(started, dt.datetime) and finished else 0.0
    totals = {"tests": str(len(cases)), "failures": str(counts["failure"]), "errors": "0",
              "skipped": str(counts["skipped"]), "time": f"{wall:.3f}"}
    root = ET.Element("testsuites", name=SUITES_NAME, **totals)
    suite = ET.SubElement(root, "testsuite", name=contract, id="0", package="onecat.gates", **totals,
                          timestamp=started.isoformat(timespec="seconds") if started else "",
                          hostname=str(run.get("writer_host") or "unknown"))
    props = ET.SubElement(suite, "properties")
    for name, value in _properties(run, run_id, verdict):
        ET.SubElement(props, "property", name=name, value=str(value))
    suite.extend(cases)
    lines = [f"{verdict['verdict']}: {verdict['reason']}", f"run {run_id}"]
    lines += [f"{c.get('name')}: {(c.find('system-out').text or '').splitlines()[0]}" for c in cases]
    ET.SubElement(suite, "system-out").text = "\n".join(lines)
    ET.indent(root)
    return ET.ElementTree(root)


def _properties(run: dict, run_id: str, verdict: dict) -> list[tuple[str, Any]]:
    return [("verdict", verdict["verdict"]), ("verdict_reason", verdict["reason"] or ""), ("run_id", run_id),
            ("contract_fingerprint", run["contract_fingerprint"]),
            ("baseline_fingerprint", run["baseline_fingerprint"] or ""),
            ("candidate_fingerprint", run["candidate_fingerprint"] or ""),
            ("engine_revision", run["engine_revision"] or ""), ("harness_revision", run["harness_revision"] or "")]


def write_junit(store: Store, run_id: str, path: str | Path) -> Path:
    """Write the run's JUnit XML to `path` (its folder is created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    junit_tree(store, run_id).write(out, encoding="utf-8", xml_declaration=True)
    return out
