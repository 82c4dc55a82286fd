"""scripts/setup_peers.sh builds llama.cpp so that its AMX path works (GCC: -fno-tree-dse -fno-dse, for
llama-server and through CMAKE_ARGS for llama-cpp-python), checks each peer answers, and rebuilds without AMX
when the native build cannot answer on an AMX CPU (--dry-run walks these paths without building anything);
scripts/check_peer.py, the check, reports a peer that dies with its signal and last output."""
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "setup_peers.sh"
STUB = Path(__file__).resolve().parent / "fixtures" / "stub_peer.py"


def _program(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def machine(tmp_path):
    """Fake compilers (GCC, clang) and CPUs (with and without AMX) for the dry runs."""
    gcc = _program(tmp_path / "gcc-12", "#!/bin/sh\necho '#define __GNUC__ 12'\n")
    clang = _program(tmp_path / "clang", "#!/bin/sh\necho '#define __GNUC__ 4'\necho '#define __clang__ 1'\n")
    (tmp_path / "amx").write_text("model name\t: Xeon\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n")
    (tmp_path / "no-amx").write_text("model name\t: EPYC\nflags\t\t: fpu avx2 avx512f\n")
    return {"gcc": gcc, "clang": clang, "amx": str(tmp_path / "amx"), "no-amx": str(tmp_path / "no-amx"),
            "peers": str(tmp_path / "peers")}


def _dry_run(machine, compiler: str, cpu: str, check: str, *peers: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CC": machine[compiler], "CXX": machine[compiler], "CPUINFO": machine[cpu],
           "DRY_RUN_CHECK": check, "ONECAT_PEERS_DIR": machine["peers"], "CFLAGS": "", "CXXFLAGS": ""}
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *peers], capture_output=True, text=True, env=env,
                          timeout=60)


def test_gcc_builds_keep_the_tile_config_stores(machine):
    done = _dry_run(machine, "gcc", "amx", "pass", "llamacpp", "llamaserver")
    assert done.returncode == 0, done.stderr
    pip_build = next(line for line in done.stdout.splitlines() if "--force-reinstall" in line)
    assert "CMAKE_ARGS=-DCMAKE_C_FLAGS=\\'-fno-tree-dse\\ -fno-dse\\'" in pip_build
    assert "-DCMAKE_CXX_FLAGS=\\'-fno-tree-dse\\ -fno-dse\\'" in pip_build and "--no-cache-dir" in pip_build
    configure = next(line for line in done.stdout.splitlines() if line.startswith("+ cmake -S"))
    assert "-DCMAKE_C_FLAGS=-fno-tree-dse\\ -fno-dse" in configure
    assert "-DCMAKE_CXX_FLAGS=-fno-tree-dse\\ -fno-dse" in configure
    checks = [line for line in done.stdout.splitlines() if "scripts/check_peer.py" in line]
    assert [line.split()[-1] for line in checks] == ["llama_cpp_serve", "llama_server"]
    assert "-mno-amx" not in done.stdout and "WITHOUT AMX" not in done.stderr
    assert not Path(machine["peers"]).exists()  # a dry run writes nothing


def test_other_compilers_get_no_gcc_flags(machine):
    done = _dry_run(machine, "clang", "amx", "pass", "llamaserver")
    assert done.returncode == 0, done.stderr
    assert "-fno-tree-dse" not in done.stdout and "not gcc" in done.stdout


def test_a_native_build_that_cannot_answer_on_amx_is_rebuilt_without_amx(machine):
    done = _dry_run(machine, "gcc", "amx", "fail-native", "llamaserver")
    assert done.returncode == 0, done.stderr
    assert "rebuilding it WITHOUT AMX" in done.stderr and "llama-server: built WITHOUT AMX" in done.stderr
    configures = [line for line in done.stdout.splitlines() if line.startswith("+ cmake -S")]
    assert len(configures) == 2 and "-mno-amx-tile" not in configures[0]
    assert "-fno-tree-dse\\ -fno-dse\\ -mno-amx-tile\\ -mno-amx-int8\\ -mno-amx-bf16" in configures[1]
    assert "amx=off: rebuilt without AMX" in done.stdout


@pytest.mark.parametrize("cpu,check", [("amx", "fail"), ("no-amx", "fail-native")])
def test_a_peer_that_cannot_answer_stops_the_script(machine, cpu, check):
    done = _dry_run(machine, "gcc", cpu, check, "llamacpp", "llamaserver")
    assert done.returncode == 1
    assert "error: the llamacpp peer is installed but cannot answer a completion" in done.stderr
    assert "llama_server" not in done.stdout  # it stopped at the first peer
    assert ("WITHOUT AMX" in done.stderr) == (cpu == "amx")


def test_check_peer_reports_a_peer_killed_by_sigsegv_and_passes_a_healthy_one(tmp_path):
    peers = tmp_path / "peers"
    (peers / "llama-server" / "bin").mkdir(parents=True)
    server = peers / "llama-server" / "bin" / "llama-server"
    env = {**os.environ, "ONECAT_PEERS_DIR": str(peers), "ONECAT_SERVER_LOG_DIR": str(tmp_path / "logs")}
    check = [sys.executable, str(ROOT / "scripts" / "check_peer.py"), "llama_server"]
    _program(server, f'#!/bin/sh\nSTUB_PEER_SIGNAL_AT_START=SIGSEGV exec "{sys.executable}" "{STUB}" "$@"\n')
    dead = subprocess.run(check, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert dead.returncode == 1, dead.stderr
    assert "llama_server: FAILED: killed by SIGSEGV (-11) before it was ready" in dead.stderr
    assert "ggml_amx_init: loading the tile config" in dead.stderr  # its last output
    _program(server, f'#!/bin/sh\nexec "{sys.executable}" "{STUB}" "$@"\n')
    (peers / "llama-server" / "build-info.txt").write_text("cflags=-fno-tree-dse -fno-dse\namx=off: rebuilt\n")
    # the healthy peer through --spec: contracts/peers_cpu.yaml with the tiny GGUF of tests/data as its model; a run
    # that gets an answer loads the model's tokenizer, and the embedded GGUF's header takes seconds to read
    spec = yaml.safe_load((ROOT / "contracts" / "peers_cpu.yaml").read_text())
    spec["model"]["source"] = str(ROOT / "tests" / "data" / "tiny-qwen35.gguf")
    (tmp_path / "peers_tiny.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    alive = subprocess.run(check + ["--spec", str(tmp_path / "peers_tiny.yaml")], capture_output=True, text=True,
                           env=env, timeout=300, cwd=ROOT)
    assert alive.returncode == 0, alive.stderr
    assert "llama_server: answered 'The capital of France is' with ' t" in alive.stdout
    assert "AMX_INT8" in alive.stdout  # the instruction sets it reported
    assert "built: {'cflags': '-fno-tree-dse -fno-dse', 'amx': 'off: rebuilt'}" in alive.stdout
