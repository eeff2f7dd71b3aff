// Weights are one part of a GpuTensor in raw ggml block bytes (ggml-common.h layouts; plus
// lathe's FP8 block F8_E4M3_B128, src/quant/fp8.rs), rows contiguous; binding 1 reads them as
// u32 words (blocks may start at any byte: Q8_0 is 34 bytes, MXFP4 17), binding 2 is the same
// buffer as 16-byte vectors for the layouts whose blocks are 16-byte aligned (Q4_K, Q5_K,
// F32/F16/BF16 rows of a multiple of 256 elements).
// Activations and outputs are f32; accumulation is f32.
//
// The wrapper defines one type flag (TY_Q4_K, ...) and the consts below. Each type block gives:
// - matmul's view: `chunk_w(b, s)`, the 32 weights of chunk s of the block at byte b, and
//   `xmap(s, j)`, the block element of the first of the 4 weights in chunk_w's vec4 j (chunk
//   shapes follow the packing: e.g. Q4_K chunk s = 16 bytes of qs, 16 weights of sub-block 2c
//   in the low nibbles and 16 of sub-block 2c+1 in the high ones);
// - matvec's view: MV_CPB lanes per block, each loading its slice of x once (`load_xc`) and
//   dotting it with that slice of R rows (`chunk_dot`). Slices are small and contiguous so that
//   neighbouring lanes read neighbouring bytes; scales are decoded once per slice, offsets and
//   mins leave the inner sums (sum (d q - m) x = d sum q x - m sum x, as ggml's vec_dot).
// All indexing of local arrays is by literal constants: with run-time indices NVIDIA's driver put
// them in local memory (the H200 ran 4x slower); literal ones stay in registers.

// ---- per-type decoders ----

#include "decode_f32"
#include "decode_f16"
#include "decode_bf16"
#include "decode_q4_0"
#include "decode_q4_1"
#include "decode_q5_0"
#include "decode_q5_1"
#include "decode_q8_0"
#include "decode_q2_k"
#include "decode_q3_k"
#include "decode_q4_k"
#include "decode_q5_k"
#include "decode_q6_k"
#include "decode_iq4_nl"
#include "decode_iq4_xs"
#include "decode_mxfp4"
#include "decode_f8_e4m3_b128"
#include "decode_mv32"
