"""`onecat bench compare` files are read with the contract reader's bounds: hostile YAML is a clear error."""
from pathlib import Path

import pytest

from onecat.gates.compare import CompareError, load_compare

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["peers_cpu.yaml", "peers_cpu_256.yaml"])
def test_shipped_peer_comparisons_load(name):
    short, long = (load_compare(ROOT / "contracts" / n) for n in ("peers_cpu.yaml", name))
    assert long.engines == short.engines  # the two specs differ in their lengths only


@pytest.mark.parametrize("text,message", [
    ("a: &a [1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n",
     "anchors and aliases are not allowed"),
    ("name: x\n" + "k: " + "[" * 20000 + "\n", "nested more than"),
    ("name: x\nseeds: [.inf]\n", "not a finite number"),
])
def test_hostile_comparison_files_are_refused(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(CompareError, match=message):
        load_compare(path)


def test_non_utf8_comparison_file_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(CompareError, match="not UTF-8"):
        load_compare(path)
