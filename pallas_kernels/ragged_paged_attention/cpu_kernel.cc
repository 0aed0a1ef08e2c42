// Ragged paged attention on the CPU: an XLA FFI custom call (see cpu.py).
//
// Same contract as reference.py: a flat ragged batch of prefill chunks and decodes,
// causal (optionally sliding-window) attention of each query token over its own
// sequence's pages, in the shared head-major layout
//
//     kv_cache[2 * Hkv, L, num_pages, page_size, D]   (float32, or bfloat16 bits as uint16,
//                                                       or int8 / float8_e4m3fn with
//     scales[2 * Hkv, L, num_pages, page_size]         a float32 scale per token and head)
//
// Work is split into tiles of one sequence, one KV head and up to kRows query rows
// (row = query token x query head sharing the KV head). For each tile, keys are taken in
// groups of 16 positions (groups start at multiples of 16), each widened to float32 once
// into a small buffer that every row of the tile reads:
//   1. scores: per row, 16 keys' 16-lane partial dot products, summed by a fixed
//      butterfly (Reduce16); a tile of many rows takes the keys transposed instead, which
//      turns the butterfly into adds of whole vectors, bitwise the same scores
//      (GroupScoresTransposed);
//   2. softmax per row over its own positions [lo, pos], exactly (two passes, no online
//      rescaling);
//   3. output: p * V accumulated in ascending position order, a few rows at a time with
//      their accumulators in registers.
// Each row's arithmetic (the order of every sum) depends only on the row itself, never
// on the tile or the batch around it, so a token's output is bit-identical however it
// was batched, whether as a decode or inside a prefill chunk.
//
// Without AVX-512 the hot loops work on 8-lane halves of the same vectors (GCC's code for
// 16-lane vectors on AVX2 spills them), with bitwise the same arithmetic.
//
// A bfloat16 cache on a CPU with AMX (cpu_amx.h) runs the same tiles on the tile unit
// instead (AmxTileRunner): the two products as bfloat16 tile products, the float32
// operands split into bfloat16 hi + lo pairs, the same softmax. Every row of such a cache
// is computed that way, so the invariance above holds there too.
//
// Built on first use by cpu.py with the machine's C++ compiler (-O3 -march=native), as one
// source with the headers beside it, each a part of this kernel:
//   cpu_tile.h             the problem (queries, paged cache, element types), a tile, and
//                          the walks from them to memory (page runs, query rows, outputs);
//   cpu_row_math.h         one row's scores, softmax and p * V, in the fixed order;
//   cpu_tile_runner.h      a tile on vector units (TileRunner), with its prefetches;
//   cpu_amx_tile_runner.h  a tile on AMX (AmxTileRunner);
// and here: the tiles of a call shared out over XLA's threads, the K/V write, the checks
// of a call's operands, and the FFI handlers.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "pallas_kernels/cpu_amx.h"
#include "pallas_kernels/cpu_bf16.h"
#include "pallas_kernels/cpu_exp.h"
#include "pallas_kernels/cpu_threads.h"
#include "pallas_kernels/ragged_paged_attention/cpu_amx_tile_runner.h"
#include "pallas_kernels/ragged_paged_attention/cpu_row_math.h"
#include "pallas_kernels/ragged_paged_attention/cpu_tile.h"
#include "pallas_kernels/ragged_paged_attention/cpu_tile_runner.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

bool AttentionUsesAmx() {
#ifdef JAXSERVE_HAVE_AMX
  return jaxserve::AmxUsable();
#else
  return false;
#endif
}

// One call's tiles, shared by the threads that work on them.
struct Work {
  Problem pb;
  std::vector<Tile> tiles;
  ffi::DataType kind = ffi::DataType::F32;  // the cache's element type
  bool amx = false;  // AmxTileRunner's tiles (a bfloat16 cache, head_dim % 32 == 0, AMX usable)
  std::atomic<size_t> next{0};  // the next tile to take
};

// Runs tiles until none is left. Which thread runs a tile never changes its result.
template <typename T, int C>
void DrainOf(Work& work) {
  TileRunner<T, C> runner(work.pb);
  for (size_t i; (i = work.next.fetch_add(1)) < work.tiles.size();) runner.Run(work.tiles[i]);
}

template <typename T>
void DrainAs(Work& work) {
  switch (work.pb.head_dim) {
    case 16: return DrainOf<T, 1>(work);
    case 32: return DrainOf<T, 2>(work);
    case 64: return DrainOf<T, 4>(work);
    case 128: return DrainOf<T, 8>(work);
    default: return DrainOf<T, 0>(work);
  }
}

void Drain(Work& work) {
#ifdef JAXSERVE_HAVE_AMX
  if (work.amx) {
    jaxserve::TileScope tiles;
    AmxTileRunner runner(work.pb);
    for (size_t i; (i = work.next.fetch_add(1)) < work.tiles.size();) runner.Run(work.tiles[i]);
    return;
  }
#endif
  switch (work.kind) {
    case ffi::DataType::U16: return DrainAs<uint16_t>(work);
    case ffi::DataType::S8: return DrainAs<int8_t>(work);
    case ffi::DataType::F8E4M3FN: return DrainAs<Fp8>(work);
    default: return DrainAs<float>(work);
  }
}

// This step's keys and values from the product (columns Hq * D on: k's heads, then v's)
// into their slots of a float32 or bfloat16 cache, k rotated as the queries are
// (ProductRow), each value rounded as XLA's cast would (Bf16Bits): what
// reference.ref_write_kv's scatter stores of QkvProduct.keys_values(). Only the
// sequences' tokens are written (the scatter also wrote padding tokens into page 0, which
// nothing reads). Throws nothing: the slots were checked.
void WriteKv(ffi::ThreadPool& pool, const Problem& pb, void* cache, bool bf16, const int32_t* slots, int32_t lo,
             int32_t hi) {
  const int64_t D = pb.head_dim, hkv = pb.num_kv_heads, k_col = pb.num_heads * D;
  constexpr int32_t kTokens = 16;  // per work item
  jaxserve::RunOnPool(pool, (hi - lo + kTokens - 1) / kTokens, [&](int item) {
    thread_local std::vector<float> buf;
    buf.resize(2 * D);
    for (int32_t t = lo + item * kTokens; t < std::min(hi, lo + (item + 1) * kTokens); ++t) {
      const int64_t page = slots[t] / pb.page_size, slot = slots[t] % pb.page_size;
      for (int64_t plane = 0; plane < 2 * hkv; ++plane) {  // k's heads, then v's
        const float* row = ProductRow(pb, t, k_col + plane * D, plane < hkv, buf.data());
        const int64_t at = CacheRow(pb, plane, page, slot) * D;
        if (bf16) {
          uint16_t* dst = static_cast<uint16_t*>(cache) + at;
          for (int64_t d = 0; d < D; ++d) dst[d] = jaxserve::Bf16Bits(row[d]);
        } else {
          std::memcpy(static_cast<float*>(cache) + at, row, D * sizeof(float));
        }
      }
    }
  });
}

// Attention of a step (the contract at the top of this file) into `out` ([T, Hq, D]), and with
// `slots` ([T]) first the step's keys and values into kv_data (WriteKv); without `out`,
// the write alone (Hq is then `num_heads`). kv_cache describes the cache's shape.
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& cos, ffi::Buffer<ffi::F32>& sin,
               ffi::AnyBuffer& kv_cache, void* kv_data, ffi::Buffer<ffi::F32>& scales, ffi::Buffer<ffi::S32>& layer,
               ffi::Buffer<ffi::S32>& kv_lens, ffi::Buffer<ffi::S32>& page_table,
               ffi::Buffer<ffi::S32>& query_start_loc, ffi::Buffer<ffi::S32>& window, float sm_scale,
               ffi::Result<ffi::AnyBuffer>* out, const ffi::Buffer<ffi::S32>* slots, int64_t num_heads = 0) {
  auto qd = q.dimensions();
  auto kd = kv_cache.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || page_table.dimensions().size() != 2 ||
      (out != nullptr && (*out)->dimensions().size() != 3)) {
    return ffi::Error::InvalidArgument(
        "q must be [slices, T, N / slices], out [T, Hq, D], kv_cache 5-D and page_table 2-D");
  }
  // [T, Hq, D]: the output's, or for a write alone q's T, num_heads and the cache's D.
  std::array<int64_t, 3> od{qd[1], num_heads, kd[4]};
  if (out != nullptr) std::copy_n((*out)->dimensions().begin(), 3, od.begin());
  if (qd[1] != od[0] || od[1] <= 0 || qd[0] * qd[2] < od[1] * od[2]) {
    return ffi::Error::InvalidArgument("q's slices must hold [T, Hq * D] of out's T, Hq and D");
  }
  const bool rotate = cos.element_count() > 0;
  auto cd = cos.dimensions(), sd = sin.dimensions();
  if (rotate && (cd.size() != 2 || cd[0] != od[0] || cd[1] != od[2] || od[2] % 2 ||
                 !std::equal(cd.begin(), cd.end(), sd.begin(), sd.end()))) {
    return ffi::Error::InvalidArgument("cos and sin must be [T, D] (an even D), or empty: q rotated already");
  }
  const ffi::DataType kind = kv_cache.element_type();
  if (kind != ffi::DataType::F32 && kind != ffi::DataType::U16 && kind != ffi::DataType::S8 &&
      kind != ffi::DataType::F8E4M3FN) {
    return ffi::Error::InvalidArgument("kv_cache must be float32, uint16 (bfloat16 bits), int8 or float8_e4m3fn");
  }
  const bool scaled = kind == ffi::DataType::S8 || kind == ffi::DataType::F8E4M3FN;
  auto scd = scales.dimensions();
  if (scaled && (scd.size() != 4 || !std::equal(scd.begin(), scd.end(), kd.begin()))) {
    return ffi::Error::InvalidArgument("an 8-bit kv_cache needs scales [2*Hkv, L, num_pages, page_size]");
  }
  auto work = std::make_unique<Work>();
  work->kind = kind;
  Problem& pb = work->pb;
  pb.q = q.typed_data();
  pb.q_slices = qd[0];
  pb.q_width = qd[2];
  pb.cos = rotate ? cos.typed_data() : nullptr;
  pb.sin = rotate ? sin.typed_data() : nullptr;
  pb.kv = kv_data;
  pb.scales = scaled ? scales.typed_data() : nullptr;
  pb.num_tokens = od[0];
  pb.num_heads = od[1];
  pb.head_dim = od[2];
  pb.num_kv_heads = kd[0] / 2;
  pb.num_layers = kd[1];
  pb.num_pages = kd[2];
  pb.page_size = kd[3];
  if (kd[4] != pb.head_dim || pb.num_heads % pb.num_kv_heads) {
    return ffi::Error::InvalidArgument("q's heads / head_dim do not match kv_cache");
  }
  pb.layer = layer.typed_data()[0];
  if (pb.layer < 0 || pb.layer >= pb.num_layers) {
    return ffi::Error::InvalidArgument("layer " + std::to_string(pb.layer) + " is not a layer of the cache");
  }
  pb.window = window.typed_data()[0];
  pb.kv_lens = kv_lens.typed_data();
  pb.page_table = page_table.typed_data();
  pb.pages_per_seq = page_table.dimensions()[1];
  pb.query_start_loc = query_start_loc.typed_data();
  pb.sm_scale = sm_scale;
  pb.out = out != nullptr ? (*out)->untyped_data() : nullptr;
  pb.out_bf16 = out != nullptr && (*out)->element_type() == ffi::DataType::BF16;
  if (out != nullptr && !pb.out_bf16 && (*out)->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("out must be float32 or bfloat16");
  }
  work->amx = kind == ffi::DataType::U16 && pb.head_dim % 32 == 0 && AttentionUsesAmx();
  const int64_t num_seqs = kv_lens.dimensions()[0];

  // Bad metadata must not read outside the buffers: check every sequence's bounds and the
  // pages it will read (a few hundred integers; the reference would clamp silently).
  if (pb.query_start_loc[0] < 0 || pb.query_start_loc[num_seqs] > pb.num_tokens) {
    return ffi::Error::InvalidArgument("query_start_loc must lie within [0, num_tokens]");
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = pb.query_start_loc[s + 1] - pb.query_start_loc[s];
    const int32_t kv_len = pb.kv_lens[s];
    if (q_len < 0 || (q_len > 0 && (kv_len < q_len || kv_len > pb.pages_per_seq * pb.page_size))) {
      return ffi::Error::InvalidArgument(
          "sequence " + std::to_string(s) + ": need 0 <= q_len <= kv_len <= pages_per_seq * page_size, got q_len " +
          std::to_string(q_len) + ", kv_len " + std::to_string(kv_len));
    }
    for (int64_t i = 0; q_len > 0 && i < (kv_len + pb.page_size - 1) / pb.page_size; ++i) {
      const int32_t page = pb.page_table[s * pb.pages_per_seq + i];
      if (page < 0 || page >= pb.num_pages) {
        return ffi::Error::InvalidArgument("page_table[" + std::to_string(s) + ", " + std::to_string(i) + "] = " +
                                           std::to_string(page) + " is not a page of the cache");
      }
    }
  }

  if (slots != nullptr) {
    const int32_t lo = pb.query_start_loc[0], hi = pb.query_start_loc[num_seqs];
    if (kind != ffi::DataType::F32 && kind != ffi::DataType::U16) {
      return ffi::Error::InvalidArgument("the kernel writes a float32 or bfloat16 cache only");
    }
    if (slots->element_count() != pb.num_tokens) return ffi::Error::InvalidArgument("slot_mapping must be [T]");
    if (pb.q_slices * pb.q_width < (pb.num_heads + 2 * pb.num_kv_heads) * pb.head_dim) {
      return ffi::Error::InvalidArgument("the product must hold [T, (Hq + 2 Hkv) * D]: q, k and v");
    }
    const int32_t* slot = slots->typed_data();
    for (int32_t t = lo; t < hi; ++t) {
      if (slot[t] < 0 || slot[t] >= pb.num_pages * pb.page_size) {
        return ffi::Error::InvalidArgument("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot[t]) +
                                           " is not a slot of the cache");
      }
    }
    WriteKv(pool, pb, kv_data, kind == ffi::DataType::U16, slot, lo, hi);
  }
  if (out == nullptr) return ffi::Error::Success();

  // Every row of a sequence's tokens is stored by its tile; the tokens outside all
  // sequences (padding) come out zero. Zeroing the whole output first was a pass over it
  // per layer (~1 MB at 512 tokens of SmolLM2, ~0.1 ms on a 2-core Xeon).
  const size_t row_bytes = static_cast<size_t>(pb.num_heads * pb.head_dim) * (pb.out_bf16 ? 2 : 4);
  char* out_bytes = static_cast<char*>(pb.out);
  std::memset(out_bytes, 0, pb.query_start_loc[0] * row_bytes);
  std::memset(out_bytes + pb.query_start_loc[num_seqs] * row_bytes, 0,
              (pb.num_tokens - pb.query_start_loc[num_seqs]) * row_bytes);
  const int32_t group = static_cast<int32_t>(pb.num_heads / pb.num_kv_heads);
  const int32_t tokens_per_tile = std::max<int32_t>(1, kRows / group);
  std::vector<Tile>& tiles = work->tiles;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = pb.query_start_loc[s + 1] - pb.query_start_loc[s];
    if (q_len <= 0) continue;
    for (int32_t h = 0; h < pb.num_kv_heads; ++h) {
      for (int32_t i = 0; i < q_len; i += tokens_per_tile) {
        tiles.push_back({s, h, i, std::min(tokens_per_tile, q_len - i)});
      }
    }
  }
  // This thread and XLA's other intra-op threads take tiles until none is left.
  const int workers = static_cast<int>(std::min<size_t>(pool.num_threads() + 1, tiles.size()));
  jaxserve::RunOnPool(pool, workers, [&](int) { Drain(*work); });
  return ffi::Error::Success();
}

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cos,
                  ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::F32> scales,
                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                  ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> window, float sm_scale,
                  ffi::Result<ffi::AnyBuffer> out) {
  return Run(pool, q, cos, sin, kv_cache, kv_cache.untyped_data(), scales, layer, kv_lens, page_table,
             query_start_loc, window, sm_scale, &out, nullptr);
}

// Attend, after writing the step's K/V into the cache in place: `cache` is kv_cache's
// buffer (the call aliases them), so the scatter XLA ran before, and its pass that rotated
// k and cast it for the cache, are gone (~2.5 ms of a 500-token SmolLM2 prefill, 2-core
// AMX Xeon).
ffi::Error WriteAndAttend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cos,
                          ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::F32> scales,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> kv_lens,
                          ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> query_start_loc,
                          ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::S32> slot_mapping, float sm_scale,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> cache) {
  if (cache->untyped_data() != kv_cache.untyped_data()) {
    return ffi::Error::InvalidArgument("the written cache must alias kv_cache (input_output_aliases)");
  }
  return Run(pool, q, cos, sin, kv_cache, cache->untyped_data(), scales, layer, kv_lens, page_table,
             query_start_loc, window, sm_scale, &out, &slot_mapping);
}

// WriteAndAttend's write alone, for a step whose attention runs for some rows only (a
// model's last layer: the rows whose logits the step needs), so that every token's K and
// V in the cache are the same bits whichever call wrote them.
ffi::Error Write(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                 ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> layer,
                 ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                 ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> window,
                 ffi::Buffer<ffi::S32> slot_mapping, int64_t num_heads, ffi::Result<ffi::AnyBuffer> cache) {
  if (cache->untyped_data() != kv_cache.untyped_data()) {
    return ffi::Error::InvalidArgument("the written cache must alias kv_cache (input_output_aliases)");
  }
  return Run(pool, q, cos, sin, kv_cache, cache->untyped_data(), scales, layer, kv_lens, page_table,
             query_start_loc, window, 1.0f, nullptr, &slot_mapping, num_heads);
}

}  // namespace

// Whether a bfloat16 cache is read with AMX tiles (a head_dim that is a multiple of 32).
extern "C" int JaxserveAttentionAmx() { return AttentionUsesAmx() ? 1 : 0; }

// For the tests: how many of the float32 values in [lo, 0] whose bit pattern is a multiple
// of `stride` from lo's get another exp from the softmax's intrinsics (ExpNonPositive512,
// ExpNonPositive256) than from ExpNonPositiveGeneric, bit for bit; -1 without AVX-512 or
// AVX2 + FMA (one code).
extern "C" int64_t JaxserveExpMismatches(float lo, uint32_t stride) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  uint32_t bits, end;
  const float zero = -0.0f;
  std::memcpy(&bits, &lo, sizeof bits);
  std::memcpy(&end, &zero, sizeof end);  // negative floats: bits fall as values rise to -0
  int64_t mismatches = 0;
  Lanes x;
  for (int64_t b = bits; b >= end;) {
    for (int i = 0; i < kLanes; ++i, b -= std::max<uint32_t>(stride, 1)) {
      const uint32_t u = static_cast<uint32_t>(std::max<int64_t>(b, end));
      std::memcpy(&x[i], &u, sizeof u);
    }
    const Lanes generic = jaxserve::ExpNonPositiveGeneric<Lanes, Ints>(x);
#ifdef __AVX512F__
    const Lanes fast = ExpNonPositive(x);
#else
    Lanes fast;
    for (int h = 0; h < 2; ++h) {
      const __m256 e = jaxserve::ExpNonPositive256(_mm256_loadu_ps(reinterpret_cast<const float*>(&x) + 8 * h));
      _mm256_storeu_ps(reinterpret_cast<float*>(&fast) + 8 * h, e);
    }
#endif
    for (int i = 0; i < kLanes; ++i) mismatches += std::memcmp(&fast[i], &generic[i], sizeof(float)) != 0;
  }
  return mismatches;
#else
  (void)lo;
  (void)stride;
  return -1;
#endif
}

// The threads every CPU kernel of the library splits its work over (cpu_threads.h).
extern "C" int JaxserveThreads() { return jaxserve::Threads(); }

// The operands of the calls that write the product's k and v (WriteAndAttend, Write).
static auto ProductWriteOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()         // XLA's intra-op threads
      .Arg<ffi::Buffer<ffi::F32>>()   // the qkv product [slices, T, N / slices]
      .Arg<ffi::Buffer<ffi::F32>>()   // cos [T, D], or empty
      .Arg<ffi::Buffer<ffi::F32>>()   // sin [T, D], or empty
      .Arg<ffi::AnyBuffer>()          // kv_cache (float32 or bfloat16 bits)
      .Arg<ffi::Buffer<ffi::F32>>()   // scales (unused)
      .Arg<ffi::Buffer<ffi::S32>>()   // layer
      .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
      .Arg<ffi::Buffer<ffi::S32>>()   // page_table
      .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
      .Arg<ffi::Buffer<ffi::S32>>()   // sliding window
      .Arg<ffi::Buffer<ffi::S32>>();  // slot_mapping [T]
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteAndAttend, WriteAndAttend,
                              ProductWriteOperands()
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>()    // [T, Hq, D] float32 or bfloat16
                                  .Ret<ffi::AnyBuffer>());  // the cache, written (aliases kv_cache)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKv, Write,
                              ProductWriteOperands()
                                  .Attr<int64_t>("num_heads")  // Hq: the product's q heads
                                  .Ret<ffi::AnyBuffer>());     // the cache, written (aliases kv_cache)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttention, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [slices, T, N / slices]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos [T, D], or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin [T, D], or empty
                                  .Arg<ffi::AnyBuffer>()          // kv_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scales (8-bit caches; else any)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sliding window
                                  .Attr<float>("sm_scale")
                                  .Ret<ffi::AnyBuffer>());        // [T, Hq, D] float32 or bfloat16
