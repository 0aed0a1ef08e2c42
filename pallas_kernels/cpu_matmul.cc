// Linear layers on the CPU through oneDNN, with weights packed once at load (see
// cpu_matmul.py).
//
// XLA:CPU hands a dot's weight to its kernel library (YNNPACK) as a plain [K, N] array
// on every call, and inside the layer scan it first copies each layer's slice out of
// the stacked weight. oneDNN's matmul instead takes weights already in the blocked
// layout its kernels read (AMX tiles or AVX-512 VNNI pairs): JaxservePack reorders each
// layer's [K, N] weight into that layout once, the model holds the packed bytes of all
// layers as one [L, bytes] array, and the FFI call reads layer l's bytes in place.
//
// A weight is packed as column slices, one per core; a call runs each slice on one of
// XLA's intra-op threads (cpu_threads.h; oneDNN's own OpenMP team stays off) into its own
// dense block of the [slices, M, N / slices] output.
//
// One packed layout serves every row count: the one oneDNN picks for kPackRows rows,
// with one primitive per row count over it (cached). The layout fixes how K is blocked,
// so a row's output does not depend on how many rows share the call, from 8 rows up
// (tests/test_cpu_matmul.py; the model never calls with fewer, though fewer may be in use:
// a decode's rows then run alone where that gives the same bits, FewRowsAgree).
//
// Without AVX-512, float32 weights run on a kernel of our own in its own packed layout
// (cpu_panels.h: each output one chain of FMAs, so a row's bits are its own at any row
// count, and a decode computes its rows only). oneDNN 3.2 has only its GEMM on plain
// weights there ("gemm:jit"; JAXSERVE_CPU_PANELS=0 keeps it, to compare against), which
// switches from its no-copy kernel to a copy-based one, with another summation order, once
// 1/N + 1/M < 0.0038 in BLAS terms (gemm_driver.cpp's nocopy_checker_avx2: N = our rows,
// M = the slice's columns). Any call of at most kMaxGemmRows = 256 rows stays on the no-copy
// kernel whatever the width, so the GEMM path runs larger calls as balanced row blocks of at
// most 256 (each >= 128), and rounds the rows in use up to 32. That kept rows independent
// where it was emulated (ONEDNN_MAX_CPU_ISA=AVX2 on AVX-512 CPUs), not on a real 2-core Zen 3:
// a 32-row call's rows there came out with other last bits than in a 512-row call.
//
// One source with its parts as headers beside it: cpu_matmul_layout.h (the packed
// layouts and the packing), cpu_matmul_execute.h (one product on one thread: oneDNN's
// primitive, AMX tiles or cpu_panels.h's loop), cpu_matmul_rows.h (a call's work items,
// its row blocks and column parts, and the rows it computes) and cpu_swiglu.h (SwiGLU's
// elementwise half). Here: the FFI calls (Matmul, MatmulSwiGlu, AddRmsNorm) and the
// functions cpu_matmul.py calls through ctypes.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "pallas_kernels/cpu_bf16.h"
#include "pallas_kernels/cpu_matmul_execute.h"
#include "pallas_kernels/cpu_matmul_layout.h"
#include "pallas_kernels/cpu_matmul_rows.h"
#include "pallas_kernels/cpu_swiglu.h"
#include "pallas_kernels/cpu_threads.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The message of the extern "C" functions' last error (JaxserveLastError).
thread_local std::string last_error;

// x [M, K] @ w[layer] -> out [slices, M, N / slices]: slice i (columns [i * N / slices,
// (i + 1) * N / slices) of the weight, packed on its own) runs on one of XLA's threads
// into its own dense block (oneDNN 3.2's fast kernels take no row stride on the output).
ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::S32> layer,
                  ffi::Buffer<ffi::S32> used, ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions();
  auto pd = packed.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 2 || od.size() != 3 || od[1] != xd[0]) {
    return ffi::Error::InvalidArgument("x must be [M, K], packed [L, bytes] and out [slices, M, N / slices]");
  }
  const bool f32 = x.element_type() == ffi::DataType::F32;
  if (!f32 && x.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("x must be float32 or bfloat16 (the packed weights' dtype)");
  }
  const int64_t rows_in_call = xd[0], k = xd[1], slices = od[0], width = od[2];
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= pd[0]) return ffi::Error::InvalidArgument("layer " + std::to_string(l) + " is not in packed");
  int64_t m;  // the rows computed; the rest come out zero
  try {
    m = RowsInUse(rows_in_call, k, width, f32, used);
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  for (int64_t i = 0; i < slices && m < rows_in_call; ++i) {
    std::memset(out->typed_data() + (i * rows_in_call + m) * width, 0, (rows_in_call - m) * width * sizeof(float));
  }
  // Row blocks: the whole call, or on the plain GEMM balanced blocks (RowBlocks).
  std::optional<RowBlocks> blocks;
  try {
    blocks.emplace(m, k, width, f32, std::max<int64_t>(m, 1));
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  int64_t slice_bytes;
  try {
    slice_bytes = SliceBytes(k, width, f32);  // kept per shape after the first call
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  if (slice_bytes * slices != pd[1]) {
    return ffi::Error::InvalidArgument("packed holds " + std::to_string(pd[1]) + " bytes per layer; " +
                                       std::to_string(slices) + " slices of a [" + std::to_string(k) + ", " +
                                       std::to_string(width) + "] weight take " + std::to_string(slice_bytes * slices));
  }
  const uint8_t* bytes = packed.typed_data() + static_cast<int64_t>(l) * pd[1];
  const CallRows rows(pool, x, m, f32, blocks->Of(0));
  return RunItems(pool, slices * blocks->count, [&](int item) {
    const int64_t i = item / blocks->count, b = item % blocks->count, row = blocks->Row(b);
    Execute(blocks->Of(b), rows.At(row), bytes + i * slice_bytes, out->typed_data() + (i * rows_in_call + row) * width,
            rows.Widened(row));
  });
}

// Rows per block of a SwiGLU call: each block's [rows, 2 * width] product lands in a
// thread's scratch and is reduced to [rows, width] from there. Smaller blocks of rows cost
// more than they saved (oneDNN rereads a slice's weights per block: a 500-token prefill's
// 30 calls took 53 ms in blocks of 128 rows, 44 in one block, 2-core AMX Xeon), so large
// calls split the columns instead (PartWidth): a work item is then one product of a part's
// gate columns and one of its up columns. Those 30 calls: 44 -> 33-36 ms so (with the
// CPU's bfloat16 conversion in Store16), against 27 ms for the bare [512, 576] x
// [576, 3072] products.
constexpr int64_t kSwiGluRows = 512;

// How a SwiGLU call of m rows over `width`-wide [gate | up] slices is split: blocks of at
// most kSwiGluRows rows (RowBlocks) and parts of `part` columns of each slice (PartWidth,
// where PartsAgree for both sizes of the blocks). Throws dnnl::error.
struct SwiGluPlan {
  SwiGluPlan(int64_t m, int64_t k, int64_t width, bool f32)
      : slice_bytes(SliceBytes(k, 2 * width, f32)), columns(Columns(k, 2 * width, f32)) {
    part = PartWidth(columns, width, std::min(m, kSwiGluRows), 2);
    blocks.emplace(m, k, part == width ? 2 * width : part, f32, kSwiGluRows);
    if (part == width) return;
    const int64_t small = m / blocks->count, large = small + (m % blocks->count ? 1 : 0);
    if (!PartsAgree(small, k, 2 * width, part, f32, columns) || !PartsAgree(large, k, 2 * width, part, f32, columns)) {
      part = width;
      blocks.emplace(m, k, 2 * width, f32, kSwiGluRows);
    }
  }
  int64_t slice_bytes, part;
  ColumnLayout columns;
  std::optional<RowBlocks> blocks;
};

// One plan per (rows, K, width, weight type), made on first use as Primitive's entries are:
// its layout queries (~10 us of oneDNN descriptor each) and PartsAgree's check stay off the
// per-call path. Throws dnnl::error.
std::shared_ptr<const SwiGluPlan> PlanFor(int64_t m, int64_t k, int64_t width, bool f32) {
  return Cached(std::make_tuple(m, k, width, f32), [&]() -> std::shared_ptr<const SwiGluPlan> {
    return std::make_shared<const SwiGluPlan>(m, k, width, f32);
  });
}

// silu(x @ gate) * (x @ up) -> out [M, I] in x's dtype. The fused weight was packed as
// `slices` column slices of [gate | up] for the same I / slices columns each
// (cpu_matmul.py: pack_swiglu); a work item is one slice (or part of one) and one block of
// rows (items alternate between slices, so a thread taking every other item stays on one
// slice's weights), multiplied into the thread's scratch, then reduced into its columns.
ffi::Error MatmulSwiGlu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> packed,
                        ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> used, ffi::Result<ffi::AnyBuffer> out,
                        int64_t slices) {
  auto xd = x.dimensions();
  auto pd = packed.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || pd.size() != 2 || od.size() != 2 || od[0] != xd[0] || slices < 1 || od[1] % slices) {
    return ffi::Error::InvalidArgument("x must be [M, K], packed [L, bytes], out [M, I] and slices divide I");
  }
  const bool f32 = x.element_type() == ffi::DataType::F32;
  if ((!f32 && x.element_type() != ffi::DataType::BF16) || out->element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument("x and out must both be float32 or both bfloat16 (the packed weights' dtype)");
  }
  const int64_t k = xd[1], width = od[1] / slices;
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= pd[0]) return ffi::Error::InvalidArgument("layer " + std::to_string(l) + " is not in packed");
  int64_t m;  // the rows computed; the rest come out zero
  try {
    m = RowsInUse(xd[0], k, 2 * width, f32, used);
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  const size_t out_row_bytes = static_cast<size_t>(od[1]) * (f32 ? 4 : 2);
  std::memset(static_cast<char*>(out->untyped_data()) + m * out_row_bytes, 0, (xd[0] - m) * out_row_bytes);
  std::shared_ptr<const SwiGluPlan> plan;
  try {
    plan = PlanFor(m, k, width, f32);
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  const int64_t slice_bytes = plan->slice_bytes, part = plan->part;
  const RowBlocks* blocks = &*plan->blocks;
  const ColumnLayout& columns = plan->columns;
  if (slice_bytes * slices != pd[1]) {
    return ffi::Error::InvalidArgument("packed holds " + std::to_string(pd[1]) + " bytes per layer; " +
                                       std::to_string(slices) + " slices of a [" + std::to_string(k) + ", " +
                                       std::to_string(2 * width) + "] weight take " +
                                       std::to_string(slice_bytes * slices));
  }
  const uint8_t* bytes = packed.typed_data() + static_cast<int64_t>(l) * pd[1];
  const CallRows x_rows(pool, x, m, f32, blocks->Of(0));
  const int64_t parts = width / part;
  return RunItems(pool, slices * parts * blocks->count, [&](int item) {
    const int64_t i = item % slices, p = item / slices % parts, b = item / slices / parts;
    const int64_t row = blocks->Row(b), rows = blocks->Row(b + 1) - row;
    thread_local std::vector<float> product;
    product.resize(std::max<size_t>(product.size(), static_cast<size_t>(rows * 2 * part)));
    const void* xr = x_rows.At(row);
    const float* wide = x_rows.Widened(row);
    const uint8_t* slice = bytes + i * slice_bytes;
    // A row's gate and up values: [gate | up] of the whole slice in one product, or a
    // part's gate columns, then its up columns, as two.
    const float *gate = product.data(), *up;
    int64_t stride;
    if (parts == 1) {
      Execute(blocks->Of(b), xr, slice, product.data(), wide);
      up = gate + width, stride = 2 * width;
    } else {
      up = gate + rows * part, stride = part;
      Execute(blocks->Of(b), xr, columns.At(slice, p * part), product.data(), wide);
      Execute(blocks->Of(b), xr, columns.At(slice, width + p * part), product.data() + rows * part, wide);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = (row + r) * od[1] + i * width + p * part;
      if (f32) {
        SwiGlu(gate + r * stride, up + r * stride, static_cast<float*>(out->untyped_data()) + at, part);
      } else {
        SwiGlu(gate + r * stride, up + r * stride, static_cast<uint16_t*>(out->untyped_data()) + at, part);
      }
    }
  });
}

// RMSNorm of rows of E values: h = weight * (x * rsqrt(mean(x * x) + eps)), with
// x = residual + the slices of a product (cpu_matmul.matmul_slices) where `y` is given
// (written back to x_out), as llama.rms_norm computes it in float32 (its sum of squares
// in a fixed order of 16 lanes, so a row's value is its own whatever the batch). One
// parallel pass over the rows where XLA ran three (the residual add, a single-threaded
// reduction, the scaling and cast: ~8 ms of a 500-token SmolLM2 prefill on a 2-core AMX
// Xeon for the two norms of each layer).
ffi::Error AddRmsNorm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> y,
                      ffi::Buffer<ffi::F32> weight, ffi::ResultBuffer<ffi::F32> x_out, ffi::Result<ffi::AnyBuffer> h,
                      float eps) {
  auto xd = x.dimensions(), yd = y.dimensions(), hd = h->dimensions();
  const bool add = y.element_count() > 0;
  if (xd.size() != 2 || hd.size() != 2 || hd[0] != xd[0] || hd[1] != xd[1] || weight.element_count() != xd[1]) {
    return ffi::Error::InvalidArgument("x and h must be [M, E] and weight [E]");
  }
  const int64_t m = xd[0], e = xd[1];
  if (add && (yd.size() != 3 || yd[1] != m || yd[0] * yd[2] != e || x_out->element_count() != m * e)) {
    return ffi::Error::InvalidArgument("y must be [slices, M, E / slices] and x_out [M, E]");
  }
  const bool bf16 = h->element_type() == ffi::DataType::BF16;
  if (!bf16 && h->element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("h must be float32 or bfloat16");
  }
  const int64_t slices = add ? yd[0] : 1, width = e / slices;
  const float *xs = x.typed_data(), *ys = y.typed_data(), *w = weight.typed_data();
  float* xo = x_out->typed_data();
  constexpr int64_t kRowsPerItem = 16;
  jaxserve::RunOnPool(pool, static_cast<int>((m + kRowsPerItem - 1) / kRowsPerItem), [&](int item) {
    thread_local std::vector<float> row;
    row.resize(e);
    for (int64_t r = item * kRowsPerItem; r < std::min(m, (item + 1) * kRowsPerItem); ++r) {
      const float* v = xs + r * e;
      if (add) {
        for (int64_t i = 0; i < slices; ++i) {
          const float* part = ys + (i * m + r) * width;
          for (int64_t j = 0; j < width; ++j) row[i * width + j] = v[i * width + j] + part[j];
        }
        std::memcpy(xo + r * e, row.data(), e * sizeof(float));
        v = row.data();
      }
      float lanes[16] = {};
      int64_t j = 0;
      for (; j + 16 <= e; j += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += v[j + l] * v[j + l];
      for (; j < e; ++j) lanes[j % 16] += v[j] * v[j];
      for (int width2 = 8; width2 > 0; width2 /= 2)
        for (int l = 0; l < width2; ++l) lanes[l] += lanes[l + width2];
      const float scale = 1.0f / std::sqrt(lanes[0] / static_cast<float>(e) + eps);
      if (bf16) {
        uint16_t* out = static_cast<uint16_t*>(h->untyped_data()) + r * e;
        for (int64_t c = 0; c < e; ++c) out[c] = jaxserve::Bf16Bits(w[c] * (v[c] * scale));
      } else {
        float* out = static_cast<float*>(h->untyped_data()) + r * e;
        for (int64_t c = 0; c < e; ++c) out[c] = w[c] * (v[c] * scale);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

extern "C" {

// Bytes of a [K, N] weight packed as `slices` column slices of N / slices; -1 on error
// (JaxserveLastError says why).
int64_t JaxservePackedBytes(int64_t k, int64_t n, int64_t slices, int f32) {
  try {
    if (slices < 1 || n % slices) throw dnnl::error(dnnl_invalid_arguments, "slices must divide N");
    return slices * SliceBytes(k, n / slices, f32 != 0);
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// Packs a row-major [K, N] weight (float32, or bfloat16 bits) into out (JaxservePackedBytes
// bytes): each column slice's packed layout, one after the other. Returns 0, or -1 on error.
int JaxservePack(const void* weight, int64_t k, int64_t n, int64_t slices, int f32, void* out) {
  try {
    if (slices < 1 || n % slices) throw dnnl::error(dnnl_invalid_arguments, "slices must divide N");
    Pack(weight, k, n, slices, f32 != 0, out);
    return 0;
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// Columns per work item of a SwiGLU call of M rows over I outputs packed as `slices`
// slices (SwiGluPlan: all I / slices, or a part), or -1 on error (JaxserveLastError says why).
int64_t JaxserveSwiGluPart(int64_t m, int64_t k, int64_t i, int64_t slices, int f32) {
  try {
    if (slices < 1 || i % slices) throw dnnl::error(dnnl_invalid_arguments, "slices must divide I");
    return PlanFor(m, k, i / slices, f32 != 0)->part;
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// Builds now what the calls of an M-row bucket (tokens or sequences) build on first use,
// for every count of rows in use (1 to M): the rows computed (RowsComputed), then the
// primitives and checks of a plain matmul of `width`-wide slices (RowBlocks) or of a
// SwiGLU call over `width` outputs per slice (PlanFor), as Matmul and MatmulSwiGlu make
// them. Returns 0, or -1 on error (JaxserveLastError says why).
int JaxservePrepareRows(int64_t m, int64_t k, int64_t width, int f32, int swiglu) {
  try {
    const int64_t n = swiglu ? 2 * width : width;  // the slice RowsInUse is asked about
    int64_t done = -1;  // RowsComputed rises with the rows in use: each count comes once in a row
    for (int64_t used = 1; used <= m; ++used) {
      const int64_t rows = RowsComputed(used, m, k, n, f32 != 0);
      if (rows == done) continue;
      done = rows;
      if (swiglu) {
        PlanFor(rows, k, width, f32 != 0);
      } else {
        RowBlocks(rows, k, width, f32 != 0, std::max<int64_t>(rows, 1));
      }
    }
    return 0;
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// The implementation that runs M rows: oneDNN's ("brg:avx512_core_amx", ...) or
// "jaxserve:panels:f32" / "jaxserve:panels:bf16" (cpu_panels.h) for one slice, or "" on error.
const char* JaxserveMatmulImpl(int64_t m, int64_t k, int64_t n, int f32) {
  static thread_local std::string impl;
  try {
    impl = Panels(f32 != 0) ? (f32 ? "jaxserve:panels:f32" : "jaxserve:panels:bf16") : OneDnnImpl(m, k, n, f32 != 0);
  } catch (const dnnl::error& e) {
    last_error = e.what();
    impl.clear();
  }
  return impl.c_str();
}

// The rows an m-row call on a [k, n] slice computes when `used` are in use (RowsComputed),
// or -1 on error (JaxserveLastError says why).
int64_t JaxserveRowsComputed(int64_t used, int64_t m, int64_t k, int64_t n, int f32) {
  try {
    return RowsComputed(used, m, k, n, f32 != 0);
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// How many slice shapes have had their few-row checks (FewRowsAgree) in this process.
int64_t JaxserveFewRowsChecks() { return few_rows_checks.load(std::memory_order_relaxed); }

// How many primitives (row count, slice shape, weight type) this process has built.
int64_t JaxservePrimitivesBuilt() { return primitives_built.load(std::memory_order_relaxed); }

// How many packed layouts this process has asked oneDNN for (PackedDesc).
int64_t JaxserveLayoutQueries() { return layout_queries.load(std::memory_order_relaxed); }

// Checks that a helper lingering after a call takes the next call's work (cpu_threads.h),
// without timing anything: call 1's two items each wait until both have started, so the
// helper scheduled for it runs one; once it lingers, call 2 (items alike) must schedule no
// task and still have its other item run by another thread. Own threads stand in for XLA's
// pool, lingering 1 s (a loaded machine may keep a thread off its core for a while).
// Returns 0, or the number of the check that failed: 1 call 1's items never met, 2 no
// helper lingered, 3 call 2 scheduled a task, 4 call 2's items never met or ran on one
// thread.
int JaxserveLingerCheck() {
  struct Pool {
    std::vector<std::thread> threads;
    int num_threads() const { return 1; }
    void Schedule(std::function<void()> task) { threads.emplace_back(std::move(task)); }
    ~Pool() {
      for (auto& t : threads) t.join();
    }
  };
  using Clock = std::chrono::steady_clock;
  // Items that each wait (up to 10 s) until both have started; records who ran them.
  auto meet = [](std::atomic<int>& started, std::thread::id* ran) {
    return [&started, ran](int i) {
      ran[i] = std::this_thread::get_id();
      started.fetch_add(1);
      for (auto until = Clock::now() + std::chrono::seconds(10); started.load() < 2 && Clock::now() < until;) {
        std::this_thread::yield();
      }
    };
  };
  Pool pool;
  std::atomic<int> started1{0}, started2{0};
  std::thread::id ran1[2], ran2[2];
  const std::function<void(int)> first = meet(started1, ran1), second = meet(started2, ran2);
  jaxserve::RunOnPool(pool, 2, first, std::chrono::seconds(1));
  if (started1.load() < 2 || ran1[0] == ran1[1]) return 1;
  jaxserve::PoolPost& post = jaxserve::Post();
  for (auto until = Clock::now() + std::chrono::seconds(10); post.lingering.load() == 0 && Clock::now() < until;) {
    std::this_thread::yield();
  }
  if (post.lingering.load() == 0) return 2;
  const size_t tasks = pool.threads.size();
  jaxserve::RunOnPool(pool, 2, second, std::chrono::seconds(1));
  if (pool.threads.size() != tasks) return 3;
  if (started2.load() < 2 || ran2[0] == ran2[1]) return 4;
  return 0;
}

// Whether m-row calls on a [k, n] slice of bfloat16 weights run as TileMatmul (1), as
// oneDNN's primitive (0), or failed to build (-1; JaxserveLastError says why).
int JaxserveMatmulTiles(int64_t m, int64_t k, int64_t n) {
  try {
    return Primitive(m, k, n, false)->tiles ? 1 : 0;
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

// Distinct values (bfloat16 bit patterns; a float32 operand's upper half) among the
// operands the bit checks use for an m-row call on a [k, n] slice (RandomOperands), or -1
// on error: a check over few distinct values (zeros, say) would pass whatever order a
// kernel sums in.
int64_t JaxserveCheckOperandValues(int64_t m, int64_t k, int64_t n, int f32) {
  try {
    const Operands ops = RandomOperands(m, k, n, f32 != 0);
    std::vector<bool> seen(1 << 16);
    for (const std::vector<uint8_t>* bytes : {&ops.x, &ops.packed}) {
      for (size_t i = f32 ? 2 : 0; i < bytes->size(); i += f32 ? 4 : 2) {
        uint16_t bits;
        std::memcpy(&bits, bytes->data() + i, sizeof bits);  // little-endian: a float32's upper half at +2
        seen[bits] = true;
      }
    }
    return std::count(seen.begin(), seen.end(), true);
  } catch (const dnnl::error& e) {
    last_error = e.what();
    return -1;
  }
}

const char* JaxserveLastError() { return last_error.c_str(); }

}  // extern "C"

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()           // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()     // packed weights [L, bytes]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()    // rows in use (RowsInUse)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // [slices, M, N / slices]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveAddRmsNorm, AddRmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [M, E]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // y [slices, M, E / slices], or empty
                                  .Arg<ffi::Buffer<ffi::F32>>()    // weight [E]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // x + y [M, E] (empty without y)
                                  .Ret<ffi::AnyBuffer>()           // h [M, E], float32 or bfloat16
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveMatmulSwiGlu, MatmulSwiGlu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA's intra-op threads
                                  .Arg<ffi::AnyBuffer>()         // x [M, K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // packed [gate | up] slices [L, bytes]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows in use (RowsInUse)
                                  .Ret<ffi::AnyBuffer>()         // [M, I], x's dtype
                                  .Attr<int64_t>("slices"));
