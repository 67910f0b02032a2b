#!/usr/bin/env bash
# Copies this machine's Eigen, oneTBB and doctest (headers, the TBB runtime, their CMake package files) into a
# prefix folder inside the checkout, for a GPU machine that has CUDA, CMake and a compiler but none of these:
# carry the folder there and configure with -DCMAKE_PREFIX_PATH=<folder>/usr (scripts/device-check.sh does).
#
# Usage, from anywhere:  scripts/pack-device-deps.sh [FOLDER]   (default .device-deps, kept out of git)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.device-deps}
for pkg in libeigen3-dev libtbb-dev doctest-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || { echo "pack-device-deps: $pkg is not installed (run scripts/setup.sh)" >&2; exit 1; }
done
rm -rf "$dest"
mkdir -p "$dest"
for pkg in libeigen3-dev libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 doctest-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || continue
  while read -r f; do
    case "$f" in /usr/share/doc/* | /usr/share/man/*) continue ;; esac
    if [[ -f "$f" || -L "$f" ]]; then
      mkdir -p "$dest$(dirname "$f")"
      cp -a "$f" "$dest$f"
    fi
  done < <(dpkg -L "$pkg")
done
grep -qx "/$dest/" .git/info/exclude 2>/dev/null || echo "/$dest/" >> .git/info/exclude
echo "pack-device-deps: $(du -sh "$dest" | cut -f1) in $dest; carry it and run scripts/device-check.sh OUTDIR there"
