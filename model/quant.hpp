// Tensor element types: half-precision conversions, quantized blocks as integer codes, dequantization to f32,
// and a row dot product. Block layouts follow ggml (all fields little-endian, f16 = IEEE binary16):
//
//   q4_0  32 values, 18 bytes: f16 d, u8 qs[16]                y[j] = (lo(qs[j]) - 8) d, y[j+16] = (hi(qs[j]) - 8) d
//   q4_1  32 values, 20 bytes: f16 d, f16 m, u8 qs[16]         y[j] = lo(qs[j]) d + m,   y[j+16] = hi(qs[j]) d + m
//   q8_0  32 values, 34 bytes: f16 d, i8 qs[32]                y[j] = qs[j] d
//   q4_K 256 values, 144 bytes: f16 d, f16 dmin, u8 scales[12], u8 qs[128]
//   q5_K 256 values, 176 bytes: f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]
//         eight sub-blocks of 32 with a 6-bit scale sc and 6-bit min mn each: y = d sc q - dmin mn
//   q6_K 256 values, 210 bytes: u8 ql[128], u8 qh[64], i8 scales[16], f16 d
//         sixteen sub-blocks of 16 with an i8 scale each: y = d scale (q - 32), q 6 bits
//   bf16  the upper 16 bits of an f32
// (lo/hi = low/high nibble.) The K-quant bit placement is spelled out in quant.cpp, and nowhere else in plain C++:
// every quantized type is read through decode_codes, which states each layout once.
//
// Codes: every quantized block is a run of groups (16 values for q6_K, 32 for the others) whose values are
//   y[k] = scale[g] * code[k] + offset[g],   code[k] an unsigned byte
// with, per type:              code                  scale        offset           largest code
//   q4_0                       nibble                d            -8 d             15
//   q4_1                       nibble                d            m                15
//   q8_0                       qs + 128              d            -128 d           255
//   q4_K / q5_K                4- / 5-bit q          d sc         -dmin mn         15 / 31
//   q6_K                       6-bit q               d scale      -32 d scale      63
// scale and offset are exact in f32 (f16 times a small integer or a power of two), and scale * code + offset is
// rounded once, so dequantize_row returns the nearest f32 to each value. Integer kernels multiply codes with
// int8 activations and apply scale and offset per group (model/linear.hpp).
#pragma once

#include <cstdint>

#include "model/gguf.hpp"

namespace cascade::gguf {

// Exact binary16 -> binary32 (subnormals, infinities and NaN included).
float fp16_to_fp32(uint16_t h);
// Round to nearest even; overflow gives infinity, NaN stays NaN.
uint16_t fp32_to_fp16(float f);
float bf16_to_fp32(uint16_t h);
// Round to nearest even; NaN stays NaN.
uint16_t fp32_to_bf16(float f);

// Types dequantize_row and dot_row handle: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K. The runtime reads
// exactly these (model/llama.cpp, model/linear.cpp and the tools ask here), and Q5_0 matrices, which the model's
// loader widens to Q8_0 (widen_q5_0_to_q8_0 below).
bool can_dequantize(TensorType t);

// Values per code group: 16 for Q6_K, 32 for Q4_0, Q4_1, Q8_0, Q4_K, Q5_K; 0 for any other type.
int64_t code_group_size(TensorType t);

// The n values stored at src as codes: code[0..n), scale and offset[0..n / code_group_size(t)). n must be a
// multiple of block_size(t); a type without codes (F32, F16, BF16, unsupported ones) throws an Error naming it.
void decode_codes(TensorType t, const void* src, int64_t n, uint8_t* code, float* scale, float* offset);
// The scales and offsets alone of the one block at src (block_size(t) / code_group_size(t) of each); Error for
// a type without codes.
void block_scales(TensorType t, const void* src, float* scale, float* offset);

// dst[0..n) = the n values stored at src. n must be a multiple of block_size(t); an unsupported type throws
// an Error naming the type (callers add the tensor name).
void dequantize_row(TensorType t, const void* src, float* dst, int64_t n);

// sum over k < n of row[k] * x[k], row stored as type t. Same contract as dequantize_row.
float dot_row(TensorType t, const void* row, const float* x, int64_t n);

// Q5_0 blocks as Q8_0 blocks holding the same values exactly, for the linear layers, which have no Q5_0 product:
//   q5_0  32 values, 22 bytes: f16 d, u32 qh, u8 qs[16]
//         y[j] = (lo(qs[j]) + 16 bit_j(qh) - 16) d,  y[j+16] = (hi(qs[j]) + 16 bit_{j+16}(qh) - 16) d
// A Q5_0 code minus 16 lies in [-16, 15], an int8, and d is kept as it is: dst's blocks (34 bytes each) are
// bit-exact Q8_0 encodings of src's. n_blocks blocks are read from src and written to dst.
void widen_q5_0_to_q8_0(const void* src, void* dst, int64_t n_blocks);

}  // namespace cascade::gguf
