// Which CPU kernel code runs a pass: its shape, its instruction-set tier and its products policy. Chosen once
// when the plan is made (cpu::choose_kernels, cpu/kernel.hpp) and kept in the plan's target, so that a benchmark
// row, a report or a bug report can say exactly what ran.
#pragma once

#include <cstdint>
#include <string>

#include "cascade/dtype.hpp"
#include "cascade/simd.hpp"

namespace cascade {

// The CPU's two kernel shapes: many stacked rows per KV head, one head a call (the shared passes); or a few rows
// per KV head, every KV head of a token range in one call (the per-sequence passes).
enum class KernelShape : uint8_t { tiled, few_rows };

// How a kernel multiplies: K/V converted to f32 (q8_0: codes times their scales, in registers) and f32
// multiply-adds; bf16 K/V on bf16 dot products (vdpbf16ps, q and the softmax weights rounded to bf16); bf16 K/V on
// AMX tiles (the same rounding); or q8_0 K/V on int8 dot products (vpdpbusd: S = Q K^T with q quantized to int8 as
// K is, per block of 32; P V in f32).
enum class Products : uint8_t { f32, bf16_dot, amx_bf16, int8_dot };

inline const char* kernel_shape_name(KernelShape s) { return s == KernelShape::tiled ? "tiled" : "few-rows"; }

inline const char* products_name(Products p) {
  switch (p) {
    case Products::f32: return "f32";
    case Products::bf16_dot: return "bf16-dot";
    case Products::amx_bf16: return "amx-bf16";
    case Products::int8_dot: return "int8-dot";
  }
  return "?";
}

struct KernelChoice {
  KernelShape shape = KernelShape::tiled;
  Isa tier = Isa::portable;  // portable: Eigen products, head by head, whatever the shape
  Products products = Products::f32;
  // f32 products on the AVX2 or AVX-512 tier in the batch-invariant order: the few-rows shape computes a row's
  // state with the tiled shape's operations (FewExactF32), so a row's (o, lse) has the same bits on either shape.
  bool batch_invariant = false;
  friend bool operator==(const KernelChoice&, const KernelChoice&) = default;
  // "avx512 tiled bf16-dot"
  std::string name() const {
    return std::string(isa_name(tier)) + " " + kernel_shape_name(shape) + " " + products_name(products);
  }
};

// A target's choices, per kernel of its schedule (0: the tiled one, 1: the few-rows one) and K/V type: a plan is
// made before the K/V it runs on, and runs on any type.
struct KernelChoices {
  KernelChoice by[2][kNumDTypes];
  const KernelChoice& operator()(int kernel, DType dt) const { return by[kernel][int(dt)]; }
};

}  // namespace cascade
