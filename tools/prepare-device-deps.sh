#!/usr/bin/env bash
# Copies the header-only dependencies (Eigen, nlohmann_json, CLI11, doctest) and fmt, with their
# CMake package files, from this machine's Debian packages into .device-deps/usr, so that a
# machine with the CUDA toolkit but no Debian packages (the lent GPU machine) can build fsdp-run:
#   run it here, then carry .device-deps and run tools/device-check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.device-deps/usr
rm -rf .device-deps
mkdir -p "$dest/include" "$dest/lib/x86_64-linux-gnu/cmake" "$dest/share/cmake" "$dest/share/eigen3" "$dest/lib/cmake"
for dir in eigen3 fmt nlohmann CLI doctest; do cp -r "/usr/include/$dir" "$dest/include/"; done
cp -a /usr/lib/x86_64-linux-gnu/libfmt.so* "$dest/lib/x86_64-linux-gnu/"
cp -r /usr/lib/x86_64-linux-gnu/cmake/fmt "$dest/lib/x86_64-linux-gnu/cmake/"
cp -r /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 "$dest/share/cmake/"
cp -r /usr/share/eigen3/cmake "$dest/share/eigen3/"
cp -r /usr/lib/cmake/doctest "$dest/lib/cmake/"
grep -qx '/.device-deps/' .git/info/exclude 2>/dev/null || echo '/.device-deps/' >> .git/info/exclude
du -sh .device-deps
# bitsandbytes for the reserved sweep's QLoRA row (tools/device-check.sh), from the torch venv when
# it is there: its Python files and its CUDA 13 libraries (PyTorch 2.11 there is built for CUDA 13;
# the other CUDA builds would not fit the carry), about 9 MB in .device-deps/python, which
# device-check.sh puts on PYTHONPATH when the machine has no bitsandbytes of its own
bnb=$(ls -d build/torch-venv/lib/python3*/site-packages/bitsandbytes 2>/dev/null | head -1 || true)
if [ -n "$bnb" ]; then
  mkdir -p .device-deps/python
  cp -r "$bnb" .device-deps/python/
  find .device-deps/python -name __pycache__ -prune -exec rm -rf {} +
  find .device-deps/python/bitsandbytes -maxdepth 1 -name 'libbitsandbytes_*' ! -name 'libbitsandbytes_cuda13*' ! -name 'libbitsandbytes_cpu*' -delete
  du -sh .device-deps/python
fi
