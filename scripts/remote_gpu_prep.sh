#!/usr/bin/env bash
# Prepares what a remote GPU machine without a package registry or model hub needs to run onecat's GPU
# benchmarks and drafter training, as files that fit size-limited transfers (docs/training.md, "Training on a
# remote GPU whose transfer limit is below the model size"):
#   DIR/wheels/    the wheels its image lacks (gguf, pydantic and its parts, fla-core, duckdb, jsonschema and
#                  its parts), for its Python (PY_VERSION, default 3.12) on manylinux x86_64
#   DIR/gguf/pNN   the embedded GGUF in parts of at most PART_MB MB (default 33), and DIR/gguf/SHA256
#   DIR/dflash_prompts.json   the held-out GSM8K / HumanEval+ chat prompts of benchmarks/speculative_gpu.py
#   DIR/drafter_prompts.jsonl with DRAFTER_PROMPTS=N: N ShareGPT prompts, later turns too (sharegpt-all:N), none
#                  overlapping the evaluation sets under ../shared/data, for `scripts/gpu_bench.sh OUT regen`
#                  (about 220 bytes a prompt)
# On the remote machine, `scripts/remote_gpu_setup.sh DIR` installs the wheels into /tmp/site and gathers the
# parts carried so far under /tmp/m, joining the GGUF (sha256 checked) once every part has arrived.
#   scripts/remote_gpu_prep.sh DIR          (run here, after scripts/setup.sh; needs the registry and ../shared)
set -euo pipefail
dir=${1:?usage: scripts/remote_gpu_prep.sh DIR}
py=${PY_VERSION:-3.12}
part_mb=${PART_MB:-33}
root=$(cd "$(dirname "$0")/.." && pwd)
venv_py=$root/.venv/bin/python
[ -x "$venv_py" ] || { echo "run scripts/setup.sh first (no $venv_py)"; exit 2; }
mkdir -p "$dir/wheels" "$dir/gguf"
"$venv_py" -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$dir/wheels" \
  gguf pydantic pydantic-core annotated-types typing-inspection fla-core duckdb jsonschema \
  jsonschema-specifications referencing rpds-py
gguf=$(cd "$root" && "$venv_py" -c "from onecat.engine.model_source import resolve_model_source as r
print(r('embedded:smollm2-135m-instruct').path)")
rm -f "$dir"/gguf/p*
split -b "$((part_mb * 1000 * 1000))" -d "$gguf" "$dir/gguf/p"
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") >"$dir/gguf/SHA256"
(cd "$root" && "$venv_py" benchmarks/speculative_gpu.py --save-prompts "$dir/dflash_prompts.json" >/dev/null)
if [ -n "${DRAFTER_PROMPTS:-}" ]; then
  (cd "$root" && ONECAT_DATA_DIR=${ONECAT_DATA_DIR:-$root/../shared/data} .venv/bin/onecat drafter prompts \
    --data "sharegpt-all:$DRAFTER_PROMPTS" --out "$dir/drafter_prompts.jsonl")
fi
echo "wheels: $(ls "$dir/wheels" | wc -l) files, $(du -sh "$dir/wheels" | cut -f1)"
echo "GGUF parts: $(ls "$dir"/gguf/p* | xargs -n1 basename | tr '\n' ' ')($(cut -c1-16 "$dir/gguf/SHA256")...)"
echo "prompts: $dir/dflash_prompts.json"
