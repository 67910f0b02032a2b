#!/usr/bin/env bash
# The concurrent parts under ThreadSanitizer: a separate build in build-tsan (g++, -fsanitize=thread), every
# report fatal. Extra arguments go to each suite (doctest flags, e.g. -tc='concurrency*').
#   scripts/tsan.sh         the suites that add threading (below)
#   scripts/tsan.sh --all   also test_llama, and test_attention's sweeps over kernel shapes
#
# What runs: the suites whose code runs on several threads at once, two at a time, each bounded in time:
#   test_concurrency  attend, forward passes over one model and one tokenizer, from several plain threads at once
#                     (each forward pass splits its matrix rows over oneTBB's threads)
#   test_attention    attend's own work items on oneTBB's threads, and attend called from parallel tasks
#   test_server_stress  the server's engine loop and API under client threads that stream, cancel and leave at
#                     random (a tiny model, a few seconds)
# and with --all:
#   test_llama        the forward pass (matrix rows split over threads) and the KV cache's three methods, which
#                     test_concurrency's forward passes run too
#   test_attention's sweeps over the kernels' shapes (sliding windows, every size of last row block, every head
#                     dim, bf16 row blocks): 72 s of its 112 s under ThreadSanitizer on a Zen 3, threaded as its
#                     random problems are; scripts/sanitize.sh and scripts/test.sh run them
#
# oneTBB. Debian's libtbb is not instrumented: the scheduler's synchronization happens inside it, where
# ThreadSanitizer cannot see it, so every parallel_for reports races between a task and the thread that waits for
# it (false ones; ~80 in test_attention alone). Suppressing them would hide real races in our own task bodies, so
# instead this script builds oneTBB itself with its TBB_SANITIZE=thread option, from the Debian source package
# of the very version installed (apt-get source, into build-tsan/onetbb, once), and builds the tests against it.
# Without libtbbmalloc beside it, that libtbb allocates with malloc, which ThreadSanitizer watches. No
# suppressions are needed or used.
set -euo pipefail
cd "$(dirname "$0")/.."
all=0
if [[ "${1:-}" == --all ]]; then
  all=1
  shift
fi
bash scripts/setup.sh

start=$SECONDS
root=$PWD/build-tsan
tbb_prefix=$root/onetbb/install
src_version=$(dpkg-query -W -f='${source:Version}' libtbb-dev)

# --- oneTBB with TBB_SANITIZE=thread, once per installed version ---
if [[ "$(cat "$tbb_prefix/version" 2>/dev/null)" != "$src_version" ]]; then
  rm -rf "$root/onetbb"
  mkdir -p "$root/onetbb/apt/lists/partial" "$root/onetbb/src"
  # A private source list and index folder: the machine's own apt configuration is left as it is.
  . /etc/os-release
  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  {
    echo "deb-src [signed-by=$keyring] http://deb.debian.org/debian $VERSION_CODENAME main"
    echo "deb-src [signed-by=$keyring] http://deb.debian.org/debian $VERSION_CODENAME-updates main"
    echo "deb-src [signed-by=$keyring] http://deb.debian.org/debian-security $VERSION_CODENAME-security main"
  } >"$root/onetbb/apt/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$root/onetbb/apt/sources.list" -o Dir::Etc::SourceParts=/nonexistent
            -o "Dir::State::Lists=$root/onetbb/apt/lists" -o APT::Sandbox::User=root)
  echo "tsan: fetching the source of onetbb $src_version" >&2
  apt-get "${apt_opts[@]}" update -qq
  # The installed version; if the archive has moved on, its current one (the tests then build against its headers).
  (cd "$root/onetbb/src" && { apt-get "${apt_opts[@]}" source --download-only -qq "onetbb=$src_version" ||
                              apt-get "${apt_opts[@]}" source --download-only -qq onetbb; })
  tar -xf "$(ls "$root"/onetbb/src/onetbb_*.orig.tar.* | head -1)" -C "$root/onetbb/src"
  tbb_src=$(find "$root/onetbb/src" -mindepth 1 -maxdepth 1 -type d -name 'oneTBB-*' | head -1)
  # The Debian patches only touch other architectures' builds and the library's own tests, built here with neither.
  echo "tsan: building $(basename "$tbb_src") with -fsanitize=thread" >&2
  cmake -S "$tbb_src" -B "$root/onetbb/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER=g++ -DTBB_SANITIZE=thread -DTBB_TEST=OFF -DTBB_EXAMPLES=OFF \
    -DTBB_STRICT=OFF -DTBBMALLOC_BUILD=OFF -DTBBMALLOC_PROXY_BUILD=OFF -DTBB_ENABLE_IPO=OFF \
    -DCMAKE_INSTALL_PREFIX="$tbb_prefix" >/dev/null
  # GCC warns (-Wtsan) that ThreadSanitizer does not model atomic_thread_fence, which oneTBB uses around putting
  # its workers to sleep and waking them; what tasks hand each other goes through atomics it does model. Those
  # warnings are about oneTBB's code, not ours: the build's output goes to a log, shown only if it fails.
  if ! cmake --build "$root/onetbb/build" -j2 >"$root/onetbb/build.log" 2>&1; then
    tail -40 "$root/onetbb/build.log" >&2
    exit 1
  fi
  cmake --install "$root/onetbb/build" >/dev/null
  echo "$src_version" >"$tbb_prefix/version"
fi

# --- the suites, against that oneTBB: an executable per suite (CASCADE_TEST_GROUPS=OFF), so only these build ---
# -g1 (functions and line tables, what a report shows) and not the Debug type's -g, which would follow it.
san="-fsanitize=thread"
cmake -S . -B build-tsan $(bash scripts/generator.sh build-tsan) -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=g++ \
  -DCMAKE_CXX_FLAGS_DEBUG="" -DCMAKE_CXX_FLAGS="-O1 -g1 $san" \
  -DCMAKE_EXE_LINKER_FLAGS="$san" -DTBB_DIR="$tbb_prefix/lib/cmake/TBB" \
  -DCASCADE_BUILD_BENCH=OFF -DCASCADE_BUILD_TOOLS=OFF -DCASCADE_CUDA=OFF -DCASCADE_KERNELS_ANY_HEAD_DIM=ON \
  -DCASCADE_TEST_GROUPS=OFF >/dev/null
suites=(test_concurrency test_attention test_server_stress)
((all)) && suites+=(test_llama)
cmake --build build-tsan -j2 --target "${suites[@]}"
# ldd's output is read whole first: `ldd | grep -q` under pipefail fails at random when grep exits at its first
# match and ldd, still writing, gets SIGPIPE.
linked=$(ldd build-tsan/tests/test_attention)
if grep -q '/libtbb.so' <<<"$linked" && ! grep -q "$tbb_prefix/lib/libtbb.so" <<<"$linked"; then
  echo "tsan: the tests do not load the instrumented libtbb from $tbb_prefix" >&2
  exit 1
fi

export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
args=("$@")
# One suite: its log in build-tsan/NAME.log, its exit code and seconds in build-tsan/NAME.result. A hung suite counts
# as a failure: 15 minutes is several times what any of them takes.
# test_llama's q8_0, bf16 and f16 cache cases and its perplexity case run the same threaded forward pass as its other
# cases, on another K/V type: under ThreadSanitizer the q8_0 and perplexity ones took most of the suite's 280 s, and
# the bf16 and f16 ones 31 s of the 149 s left on a Zen 3; scripts/sanitize.sh and scripts/test.sh run them.
skip_llama=(-tce='*q8_0 cache*,*bf16 cache*,*f16 cache*,perplexity:*')
skip_attention=()
((all)) || skip_attention=(-tce='sliding window: segments outside*,shared passes of every size*,every head dim*,bf16 shared passes*')
run_suite() {
  local t=$1 t0=$SECONDS rc=0 extra=()
  [[ "$t" == test_llama ]] && extra=("${skip_llama[@]}")
  [[ "$t" == test_attention ]] && extra=("${skip_attention[@]}")
  (cd build-tsan/tests && timeout 900 "./$t" "${args[@]}" "${extra[@]}") >"build-tsan/$t.log" 2>&1 || rc=$?
  echo "$rc $((SECONDS - t0))" >"build-tsan/$t.result"
}
# Two at a time: instrumented, a suite keeps about one core busy (test_attention and test_llama took 102 s and 80 s
# side by side here, 116 s and 81 s one after the other). test_attention, the longest, runs beside the others.
rm -f build-tsan/*.result
run_suite test_attention &
{ ((all)) && run_suite test_llama; run_suite test_concurrency; run_suite test_server_stress; } &
wait
failed=0
for t in "${suites[@]}"; do
  read -r rc secs <"build-tsan/$t.result" || { rc=1; secs=0; }
  summary=$(grep -m1 'test cases:' "build-tsan/$t.log" | sed 's/^\[doctest\] *//' || true)
  printf 'tsan: %-18s %4d s  %s\n' "$t" "$secs" "${summary:-no summary (exit $rc)}"
  if ((rc != 0)); then
    failed=1
    echo "tsan: $t failed (exit $rc); the end of build-tsan/$t.log:" >&2
    tail -60 "build-tsan/$t.log" >&2
  fi
done
((failed)) || echo "tsan: passed in $((SECONDS - start)) s"
exit $failed
