// How a call of the oneDNN linear layers is shared out: its work items over XLA's threads,
// its rows in blocks and its columns in parts that keep every row's bits its own, and
// which of its rows are computed at all (those in use, rounded up to where a row's
// product is independent of the row count).
// Part of the oneDNN linear layers, cpu_matmul.cc (whose header comment says how they
// work), included there only.

#ifndef JAXSERVE_CPU_MATMUL_ROWS_H_
#define JAXSERVE_CPU_MATMUL_ROWS_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "pallas_kernels/cpu_matmul_execute.h"
#include "pallas_kernels/cpu_matmul_layout.h"
#include "pallas_kernels/cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Internal linkage, as when all of it was one file: included into cpu_matmul.cc alone.
namespace {

// Runs item(0), ..., item(n - 1) over the pool (cpu_threads.h); the first oneDNN error any
// of them throws comes back as the call's error.
ffi::Error RunItems(ffi::ThreadPool& pool, int64_t n, const std::function<void(int)>& item) {
  std::atomic<bool> failed{false};
  std::string error;
  std::mutex error_mu;
  jaxserve::RunOnPool(pool, static_cast<int>(n), [&](int i) {
    try {
      item(i);
    } catch (const dnnl::error& e) {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!failed.exchange(true)) error = e.what();
    }
  });
  if (failed) return ffi::Error::Internal("oneDNN matmul: " + error);
  return ffi::Error::Success();
}

// A call's rows as balanced blocks of at most `max_rows` (at most kMaxGemmRows on oneDNN's
// plain GEMM, which keeps it on one kernel; at least 8 rows each where the call has them),
// so a row's product never depends on its neighbours. Block b has rows [Row(b), Row(b + 1)):
// two sizes at most, one primitive each. Throws dnnl::error.
struct RowBlocks {
  RowBlocks(int64_t m, int64_t k, int64_t n, bool f32, int64_t max_rows) : m(m) {
    const int64_t limit = Primitive(std::min(m, kMaxGemmRows), k, n, f32)->gemm ? std::min(max_rows, kMaxGemmRows)
                                                                                 : max_rows;
    count = std::max<int64_t>(1, std::min((m + limit - 1) / limit, m / 8));
    small = Primitive(m / count, k, n, f32);
    large = m % count ? Primitive(m / count + 1, k, n, f32) : small;
  }
  int64_t Row(int64_t b) const { return b * m / count; }
  const Entry& Of(int64_t b) const { return Row(b + 1) - Row(b) == m / count ? *small : *large; }

  int64_t m, count;
  std::shared_ptr<const Entry> small, large;
};

// A call's x rows as its work items hand them to Execute. Where bfloat16 rows go to the
// panels loop (which multiplies float32 rows), a call of at least kWidenOnceRows rows
// widens them to float32 once, split over the pool's threads, and every item reads them:
// each item had widened its own rows again, and a call has many (4 q|k|v slices, 2 for o
// and down, 4 slices x 3 parts x gate and up in a 512-row SwiGLU, up to 128 for the LM
// head), ~41 us each for 512 x 576 values on a 2-core Zen 3. There, 8 layers' SwiGLU at
// 512 rows took 82.3 / 84.7 against 86.4 / 85.6 ms (alternating, /tmp harness over
// cpu_matmul.swiglu; the LM head and q|k|v alike within the noise). A decode's few rows
// widen in each item as before: a row is a microsecond's work, and the calls' timings at
// 1 and 32 rows stayed within the noise either way (0.53-0.84 ms for 8 layers at 1 row).
constexpr int64_t kWidenOnceRows = 64;

class CallRows {
 public:
  CallRows(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, int64_t m, bool f32, const Entry& entry)
      : bytes_(static_cast<const char*>(x.untyped_data())), k_(x.dimensions()[1]), f32_(f32) {
    if (f32 || !entry.panels || m < kWidenOnceRows) return;
    thread_local std::vector<float> rows;  // the calling thread's: one call at a time
    rows.resize(std::max<size_t>(rows.size(), static_cast<size_t>(m * k_)));
    widened_ = rows.data();
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(bytes_);
    const int parts = static_cast<int>(std::min<int64_t>(jaxserve::Threads(), std::max<int64_t>(m, 1)));
    jaxserve::RunOnPool(pool, parts, [&](int i) {
      const int64_t from = i * m / parts, to = (i + 1) * m / parts;
      Widen(bits + from * k_, (to - from) * k_, widened_ + from * k_);
    });
  }
  const void* At(int64_t row) const { return bytes_ + row * k_ * (f32_ ? 4 : 2); }
  const float* Widened(int64_t row) const { return widened_ ? widened_ + row * k_ : nullptr; }

 private:
  const char* bytes_;
  int64_t k_;
  bool f32_;
  float* widened_ = nullptr;
};

// Bytes of float32 product one work item may fill, so that it is read back (reduced into
// the output) from the core's cache (2 MB of L2 on a 2-core AMX Xeon), not from memory:
// a 500-token prefill's gate|up products are 3 MB per slice.
constexpr int64_t kProductBytes = 512 << 10;

// Columns of a `width`-wide slice per work item: all of them, or on a blocked layout
// (Columns) the widest part that divides them in whole blocks and whose float32 products
// for `rows` rows, `products` per column (SwiGLU: gate and up), fit kProductBytes (at
// least one block). Calls of a few rows run whole slices, so a part must compute every
// value bitwise as the whole slice does (PartsAgree).
int64_t PartWidth(const ColumnLayout& layout, int64_t width, int64_t rows, int64_t products) {
  const int64_t column_bytes = products * static_cast<int64_t>(sizeof(float)) * rows;
  if (!layout.block || width % layout.block || width * column_bytes <= kProductBytes) return width;
  for (int64_t part = width - layout.block; part > layout.block; part -= layout.block) {
    if (width % part == 0 && part * column_bytes <= kProductBytes) return part;
  }
  return layout.block;
}

// Whether `part`-wide column ranges of an `n`-wide packed weight give, in calls of `rows`
// rows, bitwise the products of the whole weight. Nothing in oneDNN promises it: a kernel
// for another width may block K differently, which changes the order of a sum (an LM head
// run in parts whose width varied with the rows lost its rows' independence). Checked once
// per shape and row count (the engine's calls come in a few bucket sizes), on pseudo-random
// operands, where the weight takes at most 32 MB and the products at most 64 (larger calls
// run whole slices). Throws dnnl::error.
bool PartsAgree(int64_t rows, int64_t k, int64_t n, int64_t part, bool f32, const ColumnLayout& columns) {
  return Cached(std::make_tuple(rows, k, n, part, f32), [&] {
    const int64_t item = f32 ? 4 : 2;
    bool agree = k * n * item <= (int64_t{32} << 20) && rows * n * 4 <= (int64_t{64} << 20);
    if (agree) {
      const Operands ops = RandomOperands(rows, k, n, f32);
      std::vector<float> whole(rows * n), piece(rows * part);
      Execute(*Primitive(rows, k, n, f32), ops.x.data(), ops.packed.data(), whole.data());
      const auto narrow = Primitive(rows, k, part, f32);
      for (int64_t c = 0; agree && c < n; c += part) {
        Execute(*narrow, ops.x.data(), columns.At(ops.packed.data(), c), piece.data());
        for (int64_t r = 0; agree && r < rows; ++r) {
          agree = std::memcmp(&whole[r * n + c], &piece[r * part], part * sizeof(float)) == 0;
        }
      }
    }
    return agree;
  });
}

// The rows of an M-row call that are computed when the first `used` hold the step's tokens
// (the rest pad the token bucket): `used` (at least 1) rounded up to a multiple of
// kRowQuantum, at most M (all of them where `used` is out of range). A 300-token prompt in
// the 512-token bucket ran 512 rows of every matmul. A row's bits do not depend on how many
// rows share the call from 8 rows up (tests/test_cpu_matmul.py), the model's fewest. Each
// row count costs a primitive per shape (and its checks), 5-20 ms on its first step (M / 8
// of them at most, once per process); against 32 rows, 8 took a 270-token prefill's matmuls
// from 324-336 to 305-311 ms with AVX-512 BF16 (AMX off, 2-core Xeon) and left AMX's
// unchanged (its tiles take 16 rows). oneDNN's plain GEMM (float32 without AVX-512) keeps
// multiples of 32, the row counts its row independence was checked at: emulated here
// (ONEDNN_MAX_CPU_ISA=AVX2), it gave the last two rows of some counts other bits (8, 32, 56,
// ... rows; its blocking follows the CPU's caches, so another CPU may differ).
constexpr int64_t kRowQuantum = 8, kGemmRowQuantum = 32;

std::atomic<int64_t> few_rows_checks{0};  // shapes FewRowsAgree has looked at (for the tests)

// Whether oneDNN's primitive for u < kRowQuantum rows of [k, n] slices gives, row for row,
// the bits of its kRowQuantum-row call, on pseudo-random operands: then a decode's few rows
// run alone, where they would compute 8. Not where AMX's tiles run bfloat16 (TileMatmul:
// 16-row tiles, 1 row costs what 8 do), nor on the plain GEMM: its rows are independent at
// multiples of 32 only, so its 8-row call is no reference (emulated here, 4-7 rows matched
// it and 1-3 did not). On a 2-core AMX Xeon with AMX off, oneDNN 3.2's avx512_core_bf16
// kernel agreed for every shape of SmolLM2 and took 104 against 174 us for one row of a
// cold [576, 1536] slice, 2.0 against 2.9 ms for the LM head's (one thread); a lone decode
// 24.3-25.3 -> 19.5-20.5 ms/token (float32 with AMX on: 32.7-33.7 -> 29.1-29.6). A kernel
// of our own (vdpbf16ps over the packed blocks, oneDNN's K chunks learnt per shape) was no
// faster at 1 row and slower at 4-7.
//
// Every row count of a shape is checked at once, on the same operands against one
// reference product, when the first is asked for (the model's warm-up runs a one-token
// step for this): the LM head's slice took 12-26 ms per row count checked alone (~110 ms
// for 1-7 rows, each on the first step of its batch size), against ~40 ms for all seven.
// Throws dnnl::error.
bool FewRowsAgree(int64_t u, int64_t k, int64_t n, bool f32) {
  const auto agree = Cached(std::make_tuple(k, n, f32), [&] {
    few_rows_checks.fetch_add(1, std::memory_order_relaxed);
    std::array<bool, kRowQuantum> agree{};  // by row count; none where they do not run alone
#ifdef JAXSERVE_HAVE_AMX
    if (!f32 && jaxserve::AmxUsable()) return agree;
#endif
    if (Primitive(kMaxGemmRows, k, n, f32)->gemm) return agree;
    const Operands ops = RandomOperands(kRowQuantum, k, n, f32);
    std::vector<float> theirs(kRowQuantum * n), ours(kRowQuantum * n);
    Execute(*Primitive(kRowQuantum, k, n, f32), ops.x.data(), ops.packed.data(), theirs.data());
    for (int64_t rows = 1; rows < kRowQuantum; ++rows) {
      Execute(*Primitive(rows, k, n, f32), ops.x.data(), ops.packed.data(), ours.data());
      agree[rows] = std::memcmp(theirs.data(), ours.data(), rows * n * sizeof(float)) == 0;
    }
    return agree;
  });
  return u > 0 && u < kRowQuantum && agree[u];
}

// The rows an M-row call computes when the first u hold the step's tokens (RowsInUse).
// Which quantum applies is asked of the kMaxGemmRows-row primitive, whatever M, and never
// a few rows' (AMX's tile loop would then check its bits for a row count the call may not
// run). cpu_matmul.py asks the same (rows_computed). Throws dnnl::error.
int64_t RowsComputed(int64_t u, int64_t m, int64_t k, int64_t n, bool f32) {
  if (u < 0 || u >= m) return m;
  u = std::max<int64_t>(u, 1);
  if (Panels(f32)) return u;  // every row its own at any row count (cpu_panels.h)
  if (u < kRowQuantum && FewRowsAgree(u, k, n, f32)) return u;
  const int64_t q = Primitive(kMaxGemmRows, k, n, f32)->gemm ? kGemmRowQuantum : kRowQuantum;
  return std::min(m, (u + q - 1) / q * q);
}

int64_t RowsInUse(int64_t m, int64_t k, int64_t n, bool f32, const ffi::Buffer<ffi::S32>& used) {
  return RowsComputed(used.element_count() ? used.typed_data()[0] : m, m, k, n, f32);
}

}  // namespace

#endif  // JAXSERVE_CPU_MATMUL_ROWS_H_
