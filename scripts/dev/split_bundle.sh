#!/usr/bin/env bash
# Re-split the offline vLLM bundle (.gpu-bundle/part.aa.. from ../shared/gpu-offline/build.py) into 42 MB parts
# under .gpu-bundle/q/, so that one part plus the working tree stays under the device's 64 MiB carry limit (the
# tracked tree alone is ~17 MB, so a part leaves ~8 MB: carry .gpu-carry's extras, py-spy and the tokenizer, as one
# tarball, e.g. `tar czf .gpu-carry/extra.tgz -C .gpu-carry py-spy tok SHA`, ~3.5 MB, and untar it on the device).
# Carry q/part.a (with q/unpack.sh), then b, c, d, one per call, into /root/parts/, then
# `. scripts/gpu_env.sh /root/parts`: unpack.sh concatenates part.* in name order.
set -euo pipefail
cd "$(dirname "$0")/../../.gpu-bundle"
rm -rf q && mkdir q
cat part.a? | split -b 42000000 -a 1 - q/part.
cp unpack.sh q/
[ "$(cat part.a? | md5sum)" = "$(cat q/part.* | md5sum)" ] && ls -l q
