// q8_0 K/V from Python (cascade/q8_0.hpp): a K or V argument given as its int8 codes (..., head_dim) and its
// float16 scales (..., head_dim / 32), one scale per 32 codes of a head's row, held together by a Q8_0 object.
// The codes and scales stay the caller's arrays (NumPy or PyTorch CPU), read in place by the kernels.
#pragma once

#include <nanobind/nanobind.h>

#include "arrays.hpp"

namespace cascade::py {

// What a Q8_0 object holds: the two arrays as given.
struct Q8Arrays {
  nb::object codes, scales;
};

// The Q8_0 object h is, or nullptr when h is not one.
const Q8Arrays* as_q8(nb::handle h);

// Checks a q8_0 pair on its own, whatever the plan: codes of int8 and scales of float16 elements (else
// TypeError), codes' last extent (head_dim) a positive multiple of 32 and scales shaped as the codes with it
// divided by 32 (else ValueError); messages name them cn and sn.
void check_q8(const ArrayRef& codes, const ArrayRef& scales, Name cn, Name sn);

}  // namespace cascade::py
