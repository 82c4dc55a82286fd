"""gate run --junit: the XML parses and follows the JUnit schema CI readers use (Jenkins' junit-10.xsd, which
GitHub test-report actions and GitLab read too), for PROMOTE, ROLLBACK and INCONCLUSIVE runs."""
import re
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

import gate_fakes
from onecat.gates.gate_run import run_gate
from onecat.reports.junit import write_junit
from onecat.results.store import Store

TESTCASE_CHILDREN = {"skipped", "error", "failure", "system-out", "system-err"}
TIMESTAMP = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}$")  # junit-10.xsd: ISO 8601, no time zone

GATES = {  # verdict -> the fake contract's gates that give it
    "PROMOTE": None,
    "ROLLBACK": ("max_relative: 0.01}", "max_relative: 1.0e-9}"),  # fp8 KV noise now fails ppl_delta
    "INCONCLUSIVE": ("min_rate: 0.5, min_samples: 4}", "min_rate: 0.5, min_samples: 100000}"),
}


def _run(tmp_path, verdict):
    path = gate_fakes.write_fake_contract(tmp_path)
    if GATES[verdict]:
        path.write_text(path.read_text().replace(*GATES[verdict]))
    outcome = run_gate(path, tmp_path / "r.duckdb", report_dir=tmp_path / "report")
    assert outcome.verdict.decision == verdict
    return outcome


def _validate(root: ET.Element) -> ET.Element:
    """The structural rules of junit-10.xsd, written out: returns the one testsuite."""
    assert root.tag == "testsuites"
    suites = list(root)
    assert [s.tag for s in suites] == ["testsuite"]
    suite, = suites
    for attr in ("name", "tests", "failures", "errors", "skipped", "time", "timestamp", "hostname", "id", "package"):
        assert suite.get(attr) is not None, attr
    assert TIMESTAMP.match(suite.get("timestamp")) and float(suite.get("time")) >= 0
    tags = [c.tag for c in suite]
    assert tags[0] == "properties" and tags[-1] == "system-out"  # properties, testcase*, system-out
    assert set(tags[1:-1]) == {"testcase"}
    for prop in suite.find("properties"):
        assert prop.tag == "property" and prop.get("name") and prop.get("value") is not None
    cases = suite.findall("testcase")
    outcome = {"failure": 0, "error": 0, "skipped": 0}
    for case in cases:
        assert case.get("name") and case.get("classname") == suite.get("name")
        children = [c.tag for c in case]
        assert set(children) <= TESTCASE_CHILDREN
        assert sum(children.count(t) for t in outcome) <= 1  # one outcome at most; none = passed
        for tag in outcome:
            outcome[tag] += children.count(tag)
        for failure in case.findall("failure"):
            assert failure.get("message") is not None and failure.get("type")
        for skipped in case.findall("skipped"):
            assert skipped.get("message")
    assert int(suite.get("tests")) == len(cases)
    assert (int(suite.get("failures")), int(suite.get("errors")), int(suite.get("skipped"))) == \
        (outcome["failure"], outcome["error"], outcome["skipped"])
    for attr in ("tests", "failures", "errors", "skipped"):
        assert root.get(attr) == suite.get(attr)
    return suite


@pytest.mark.parametrize("verdict", ["PROMOTE", "ROLLBACK", "INCONCLUSIVE"])
def test_junit_xml_validates_and_mirrors_the_gates(tmp_path, verdict):
    outcome = _run(tmp_path, verdict)
    with Store(tmp_path / "r.duckdb", read_only=True) as store:
        path = write_junit(store, outcome.run_id, tmp_path / "ci" / "gate.xml")
    suite = _validate(ET.parse(path).getroot())
    assert path.read_bytes().startswith(b"<?xml")
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["verdict"] == verdict and props["run_id"] == outcome.run_id
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert list(cases) == [gate.id for gate, _ in outcome.results]  # one testcase per gate, in order
    for gate, result in outcome.results:
        case = cases[gate.id]
        if result.status == "fail" and not gate.informative:
            assert case.find("failure").get("message") == result.summary
        elif result.status == "inconclusive":
            assert case.find("skipped").get("message").startswith("INCONCLUSIVE")
        elif result.status == "pass":
            assert case.find("failure") is None and case.find("skipped") is None
    failed = [g.id for g, r in outcome.results if r.status == "fail" and not g.informative]
    assert (verdict == "ROLLBACK") == bool(failed) == (int(suite.get("failures")) > 0)
    if verdict == "INCONCLUSIVE":
        assert int(suite.get("skipped")) >= 1
    assert suite.find("system-out").text.startswith(f"{verdict}: ")


def test_cli_writes_junit_next_to_the_verdict(tmp_path):
    from onecat.cli.main import app

    path = gate_fakes.write_fake_contract(tmp_path)
    junit = tmp_path / "out" / "gate.xml"
    result = CliRunner().invoke(app, ["gate", "run", str(path), "--db", str(tmp_path / "r.duckdb"), "--out",
                                      str(tmp_path / "report"), "--junit", str(junit), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert f"junit: {junit}" in result.output.replace("\n", "")
    suite = _validate(ET.parse(junit).getroot())
    assert {p.get("name"): p.get("value") for p in suite.find("properties")}["verdict"] == "PROMOTE"
