#!/usr/bin/env bash
# llama.cpp beside cascade: builds llama.cpp (CPU only) from the source the llama-cpp-python 0.3.36 source
# distribution carries, builds bench/llama-cpp-client.cpp against it, and runs the client with the arguments
# given (see the client's header: the decode loop of cascade-generate, one JSON object on stdout).
#
#   bench/llama-cpp.sh [--build-only] [CLIENT ARGS...]
#
# The source (the llama-cpp-python 0.3.36 sdist, from the package index, its sha256 checked) is fetched once into the
# cache folder ($CASCADE_LLAMA_CPP_CACHE, default ${XDG_CACHE_HOME:-~/.cache}/cascade-llama-cpp), which also keeps
# the build. $CASCADE_LLAMA_CPP_SRC points at an unpacked llama.cpp source instead. llama.cpp is built for this
# machine (GGML_NATIVE) with OpenMP, as its own build does by default.
#
# A missing package, a failed download or a failed build is one line on stderr (`llama-cpp.sh: ...`, the log's
# path in it) and exit code 1.
set -uo pipefail

version=0.3.36
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${CASCADE_LLAMA_CPP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cascade-llama-cpp}"
die() { echo "llama-cpp.sh: $*" >&2; exit 1; }

build_only=0
if [ "${1:-}" = "--build-only" ]; then build_only=1; shift; fi
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n 2,15p "$0"; exit 0; fi

mkdir -p "$cache" 2>/dev/null || die "cannot create the cache folder $cache"
for tool in cmake cc c++ tar python3; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is not installed (needed to build llama.cpp)"
done

# --- the source ----------------------------------------------------------------------------------------
src="${CASCADE_LLAMA_CPP_SRC:-$cache/llama_cpp_python-$version/vendor/llama.cpp}"
if [ ! -f "$src/include/llama.h" ]; then
  [ -z "${CASCADE_LLAMA_CPP_SRC:-}" ] || die "CASCADE_LLAMA_CPP_SRC=$src holds no include/llama.h"
  tarball="$cache/llama_cpp_python-$version.tar.gz"
  if [ ! -f "$tarball" ]; then
    echo "llama-cpp.sh: downloading the llama-cpp-python $version source distribution into $cache" >&2
    # The package index's page for the project names the file with its sha256; fetched from there, the file is
    # the one pip would take. `pip download --no-binary :all:` gets the same file but first builds the sdist's
    # build backend and every one of its build dependencies from source (tens of minutes on 2 cores): it is the
    # fallback where the index has no such page.
    index="${PIP_INDEX_URL:-https://pypi.org/simple}"
    if ! python3 - "$index" "$version" "$tarball" > "$cache/download.log" 2>&1 <<'PY'
import hashlib, re, sys, urllib.parse, urllib.request
index, version, out = sys.argv[1].rstrip("/"), sys.argv[2], sys.argv[3]
page = urllib.request.urlopen(f"{index}/llama-cpp-python/", timeout=60)
html = page.read().decode()
name = re.escape(f"llama_cpp_python-{version}.tar.gz")
m = re.search(r'href="([^"]*/' + name + r'#sha256=([0-9a-f]{64}))"', html)
if not m:
    sys.exit(f"{index}/llama-cpp-python/ lists no {name} with a sha256")
url = urllib.parse.urljoin(page.geturl(), m.group(1).replace("&amp;", "&"))
data = urllib.request.urlopen(url, timeout=600).read()
if hashlib.sha256(data).hexdigest() != m.group(2):
    sys.exit(f"{url}: sha256 differs from the index's")
with open(out + ".part", "wb") as f:
    f.write(data)
PY
    then
      rm -f "$tarball.part"
      python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$cache" \
        >> "$cache/download.log" 2>&1 ||
        die "download of llama-cpp-python==$version failed (see $cache/download.log)"
    else
      mv "$tarball.part" "$tarball"
    fi
    [ -f "$tarball" ] || die "the download gave no $tarball (see $cache/download.log)"
  fi
  tar -xzf "$tarball" -C "$cache" 2>"$cache/untar.log" || die "cannot unpack $tarball (see $cache/untar.log)"
  [ -f "$src/include/llama.h" ] || die "$tarball holds no vendor/llama.cpp"
fi

# --- llama.cpp, CPU only ---------------------------------------------------------------------------------
# Without its AMX matrix products: on a CPU with AMX, GGML_NATIVE compiles them in, and in this version their
# first tile load on a worker thread dies of SIGILL (the tile configuration is not in place; llama.cpp pull
# request #26954). Its AVX-512 products run instead, as on any CPU without AMX.
no_amx=""
if echo 'int main(void) { return 0; }' | cc -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -x c - -o /dev/null 2>/dev/null; then
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
build="$cache/build-$version-no-amx"
log="$build/build.log"
mkdir -p "$build"
if [ ! -f "$build/bin/libllama.so" ]; then
  echo "llama-cpp.sh: building llama.cpp in $build (a few minutes)" >&2
  {
    cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON \
      -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
      -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF -DGGML_OPENCL=OFF \
      -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF &&
      cmake --build "$build" -j"$(nproc 2>/dev/null || echo 2)" --target llama
  } > "$log" 2>&1 || die "building llama.cpp failed (see $log)"
fi
client="$build/llama-cpp-client"
if [ ! -x "$client" ] || [ "$root/bench/llama-cpp-client.cpp" -nt "$client" ]; then
  c++ -O2 -std=c++17 "$root/bench/llama-cpp-client.cpp" -I"$src/include" -I"$src/ggml/include" -L"$build/bin" \
    -lllama -lggml -lggml-base -Wl,-rpath,"$build/bin" -o "$client" > "$build/client.log" 2>&1 ||
    die "building the client failed (see $build/client.log)"
fi
[ "$build_only" = 1 ] && { echo "$client"; exit 0; }
exec "$client" "$@"
