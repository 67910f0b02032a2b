// The parts of the extension module cascade._cascade, each defined in its own unit.
#pragma once

#include <nanobind/nanobind.h>

namespace cascade::py {

void bind_states(nanobind::module_& m);     // states.cpp: merge_state, merge_state_in_place, merge_states
void bind_q8(nanobind::module_& m);         // q8.cpp: Q8_0, quantize_q8_0
void bind_attention(nanobind::module_& m);  // attention.cpp: CostModel, Plan, SplitLayout, UnifiedLayout
void bind_generate(nanobind::module_& m);   // generate.cpp: Model

}  // namespace cascade::py
