#!/usr/bin/env bash
# On the remote GPU machine (its python3 holds torch): installs the wheels that scripts/remote_gpu_prep.sh put in
# DIR/wheels into /tmp/site (once per machine; export PYTHONPATH=/tmp/site afterwards), copies whichever GGUF
# parts this call carried into /tmp/m, and joins them into /tmp/m/<the GGUF's name> once all have arrived
# (parts may come over consecutive calls to a machine that stays warm), checking the sha256.
#   source scripts/remote_gpu_setup.sh DIR
dir=${1:?usage: source scripts/remote_gpu_setup.sh DIR}
if [ ! -f /tmp/site/.installed ] && [ -d "$dir/wheels" ]; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/site "$dir"/wheels/*.whl && touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
mkdir -p /tmp/m
for p in "$dir"/gguf/p*; do [ -f "$p" ] && cp "$p" /tmp/m/; done
[ -f "$dir/gguf/SHA256" ] && cp "$dir/gguf/SHA256" /tmp/m/
if [ -f /tmp/m/SHA256 ]; then
  want=$(cut -d' ' -f1 /tmp/m/SHA256); name=$(awk '{print $2}' /tmp/m/SHA256)
  if [ ! -f "/tmp/m/$name" ]; then
    count=$(ls /tmp/m/p* 2>/dev/null | wc -l)
    cat /tmp/m/p* >"/tmp/m/$name.partial"
    if [ "$(sha256sum "/tmp/m/$name.partial" | cut -d' ' -f1)" = "$want" ]; then
      mv "/tmp/m/$name.partial" "/tmp/m/$name"; echo "joined /tmp/m/$name from $count parts"
    else
      rm -f "/tmp/m/$name.partial"; echo "GGUF not complete yet: $count part(s) under /tmp/m"
    fi
  fi
fi
