// The fuzz targets run oneTBB's parallel loops on the calling thread alone. A campaign is one process per core,
// and oneTBB's workers waiting beside it for the next loop took about a third of the CPU (perf, fuzz_model): time
// not spent on inputs. The loops still split their ranges as they do on several threads; races between threads are
// ThreadSanitizer's to find (scripts/tsan.sh).
#pragma once

#include <oneapi/tbb/global_control.h>

inline void fuzz_on_one_thread() {
  static oneapi::tbb::global_control one(oneapi::tbb::global_control::max_allowed_parallelism, 1);
}
