# Sourced by this folder's device scripts: $out, the peers' wheels and FlashKDA's
# extension on PYTHONPATH (they travel in the carried .whl and .peers folders).
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONPATH="$PWD/src"
python3 -m pip install -q --no-index --no-deps --target /tmp/kda-site .whl/*.whl >/dev/null 2>&1
mkdir -p /tmp/kda-peers && cp -r .peers/flash_kda /tmp/kda-peers/ \
  && gunzip -c .peers/flash_kda_C.so.gz > /tmp/kda-peers/flash_kda_C.cpython-312-x86_64-linux-gnu.so
export PYTHONPATH="$PYTHONPATH:/tmp/kda-site:/tmp/kda-peers"
