// cascade: prefix-aware ("cascade") attention. The one header an integrator includes.
//
//   state.hpp          attention state (o, lse) and its exact merge
//   dtype.hpp          K/V element types (f32, f16, bf16)
//   kv.hpp             views of one KV span, contiguous or paged
//   tree.hpp           a step's structure: the forest of segments (lengths) and the sequences attending it
//   schedule.hpp       passes, work items and merge lists: one schedule for every backend
//   auto.hpp           the cost model and the per-segment shared/folded choice
//   plan.hpp           a step's plan: tree, auto's choice, schedule, workspace size; no K/V pointers
//   cpu/attention.hpp  planning and running on the CPU (cascade, split), and the unified baseline
//   cpu/calibrate.hpp  fitting the cost model on this machine
//   cpu/profile_cache.hpp  the fitted model kept per machine in the user's cache folder
//   layouts.hpp        the split and unified baselines' layouts, built from a tree and its K/V
//   reference.hpp      the double-precision reference
#pragma once

#include "cascade/auto.hpp"
#include "cascade/cpu/attention.hpp"
#include "cascade/cpu/calibrate.hpp"
#include "cascade/cpu/profile_cache.hpp"
#include "cascade/dtype.hpp"
#include "cascade/error.hpp"
#include "cascade/kv.hpp"
#include "cascade/layouts.hpp"
#include "cascade/plan.hpp"
#include "cascade/q8_0.hpp"
#include "cascade/reference.hpp"
#include "cascade/schedule.hpp"
#include "cascade/state.hpp"
#include "cascade/tree.hpp"
#include "cascade/version.hpp"
