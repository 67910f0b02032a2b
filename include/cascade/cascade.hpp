// cascade: prefix-aware ("cascade") attention. The one header an integrator includes.
//
//   state.hpp        attention state (o, lse) and its exact merge
//   dtype.hpp        K/V element types (f32, f16, bf16)
//   kv.hpp           views of one KV span, contiguous or paged
//   plan.hpp         the forest of segments and the sequences attending it
//   cpu/attention.hpp  running a plan (cascade, split) and the unified baseline on the CPU
//   layouts.hpp      the split and unified baselines' layouts, built from a plan
//   reference.hpp    the double-precision reference
//   auto.hpp         a cost model fitted on the machine, and the per-segment shared/folded choice
#pragma once

#include "cascade/auto.hpp"
#include "cascade/cpu/attention.hpp"
#include "cascade/dtype.hpp"
#include "cascade/error.hpp"
#include "cascade/kv.hpp"
#include "cascade/layouts.hpp"
#include "cascade/plan.hpp"
#include "cascade/reference.hpp"
#include "cascade/state.hpp"
