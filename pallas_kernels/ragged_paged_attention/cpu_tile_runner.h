// TileRunner: one tile of the CPU attention kernel on vector units (every cache dtype and
// head_dim), its keys and values fetched ahead of their use.
// Part of the CPU attention kernel, cpu_kernel.cc (whose header comment states the
// contract), included there only.

#ifndef JAXSERVE_RAGGED_PAGED_ATTENTION_CPU_TILE_RUNNER_H_
#define JAXSERVE_RAGGED_PAGED_ATTENTION_CPU_TILE_RUNNER_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX__
#include <immintrin.h>
#endif

#include "pallas_kernels/ragged_paged_attention/cpu_row_math.h"
#include "pallas_kernels/ragged_paged_attention/cpu_tile.h"

// Internal linkage, as when all of it was one file: these headers are included into
// cpu_kernel.cc alone.
namespace {

// T: the cache's element type (an 8-bit one's rows are widened times their scales). C:
// head_dim / 16 when the dispatch knows it (1, 2, 4, 8),
// so a K or V row lives in registers; 0 for any other head_dim (zero-padded chunks).
//
// Keys are taken in groups of 16 positions starting at multiples of 16, widened to
// float32 (for a tile of many rows also transposed) once per tile into a small buffer;
// every row of the tile reads them there.
template <typename T, int C>
class TileRunner {
 public:
  explicit TileRunner(const Problem& pb) : pb_(pb) {}

  // Rows of a tile summed together in GroupValues (their accumulators fit in registers).
  static constexpr int kValueRows = C >= 8 ? 2 : C >= 4 ? 4 : 8;
  // Rows scored together by GroupScoresTransposed (~5 of its vectors per row stay in
  // registers: 32 of them with AVX-512, 16 of half the width without), and the fewest
  // rows of a tile for which transposing its keys pays (~5 ns saved per row against
  // 25-65 ns per group's transpose).
#ifdef __AVX512F__
  static constexpr int kScoreRows = 4;
#else
  static constexpr int kScoreRows = 2;
#endif
  static constexpr int kTransposeRows = 12;
  // A bfloat16 cache's values read in place by a one-block tile (Run, step 3): AVX-512's.
#ifdef __AVX512F__
  static constexpr bool kValuesInPlace = std::is_same_v<T, uint16_t> && C > 0;
#else
  static constexpr bool kValuesInPlace = false;
#endif

  void Run(const Tile& t) {
    const Problem& pb = pb_;
    const int64_t D = pb.head_dim, G = pb.num_heads / pb.num_kv_heads;
    const int64_t chunks = C > 0 ? C : (D + kLanes - 1) / kLanes;  // head_dim in 16-lane chunks
    const int rows = t.num_tokens * static_cast<int>(G);

    // Rows: position, lowest visible position, scaled query.
    qs_.assign(static_cast<size_t>(rows) * chunks, Lanes{});
    TileRows(pb, t, pos_, lo_, [&](int r, const float* q) {
      float* qs = reinterpret_cast<float*>(&qs_[r * chunks]);
      for (int64_t d = 0; d < D; ++d) qs[d] = q[d] * pb.sm_scale;
    });
    const int32_t jlo = lo_[0];              // the tile's lowest visible position
    const int32_t jhi = pos_[rows - 1] + 1;  // one past its highest
    const int32_t base = jlo - jlo % kLanes;  // the first group's first position
    const int32_t groups = (jhi - base + kLanes - 1) / kLanes;
    const int64_t width = static_cast<int64_t>(groups) * kLanes;  // scores per row, from base
    scores_.resize(static_cast<size_t>(rows) * width);
    group_.resize(static_cast<size_t>(kLanes) * chunks);
    keys_.resize(static_cast<size_t>(kLanes) * chunks);

    // Fetch ahead: the pages are scattered, and misses in flight beat one demand miss
    // after another. The first groups of K and V now; each LoadGroup then asks for the
    // group kAhead further on.
    for (int32_t g = 0; g < std::min(groups, kAhead); ++g) {
      Prefetch(t.seq, t.kv_head, base + g * kLanes, jlo, jhi);
      Prefetch(t.seq, pb.num_kv_heads + t.kv_head, base + g * kLanes, jlo, jhi);
    }

    // 1. Scores, a group of 16 keys at a time (a row's scores outside [lo, pos] are not
    // read): per row, or with the keys transposed kScoreRows rows at a time, every block
    // of rows of which one sees the group.
    // (Not for head_dim <= 16: there the products would meet the butterfly's first adds
    // directly, and GCC would fuse them into multiply-adds, GroupScores' scores no more.)
    const bool transposed = rows >= kTransposeRows && chunks > 1;
    for (int32_t g = 0; g < groups; ++g) {
      const int32_t first = base + g * kLanes;
      if (!transposed) {
        LoadGroup(t.seq, t.kv_head, first, jlo, jhi, /*defer=*/true);
        const int64_t share = (pending_lines_ + rows - 1) / rows;
        for (int r = 0; r < rows; ++r) {
          if (first <= pos_[r] && first + kLanes > lo_[r]) {
            GroupScores<C>(&qs_[r * chunks], group_.data(), chunks, &scores_[r * width + g * kLanes]);
          }
          Pump(share);
        }
        continue;
      }
      LoadKeys(t.seq, t.kv_head, first, jlo, jhi);
      for (int r0 = 0; r0 < rows; r0 += kScoreRows) {
        const int n = std::min(kScoreRows, rows - r0);
        bool any = false;
        for (int r = r0; r < r0 + n; ++r) any |= first <= pos_[r] && first + kLanes > lo_[r];
        if (any) ScoreRows(r0, n, &scores_[r0 * width + g * kLanes], width);
      }
    }

    // 2. Softmax per row over its own positions [lo, pos] (zeros outside them).
    denom_.resize(rows);
    for (int r = 0; r < rows; ++r) {
      float* s = &scores_[r * width];
#ifdef __AVX512F__
      denom_[r] = SoftmaxRow(s, base, lo_[r], pos_[r], [s](int32_t g, Lanes p) { std::memcpy(s + g * kLanes, &p, sizeof p); });
#else
      denom_[r] = SoftmaxRowHalves(s, base, lo_[r], pos_[r]);
#endif
    }

    // 3. Output: sum of p * V in ascending position order, per row, kValueRows rows at once
    // (the last block's spare rows have empty key ranges: they add nothing).
    const int padded_rows = (rows + kValueRows - 1) / kValueRows * kValueRows;
    const int64_t blocks = padded_rows / kValueRows;
    acc_.assign(static_cast<size_t>(padded_rows) * chunks, Lanes{});
    static const float kZeros[kLanes] = {};
    const int64_t v_plane = pb.num_kv_heads + t.kv_head;
    // A tile of one block of rows (a decode's) reads a bfloat16 cache's values where they
    // lie (GroupValuesFromRows): each serves the block once, and widening it into group_
    // first only stored and loaded it once more.
    const bool in_place = kValuesInPlace && blocks == 1 && !transposed;
    for (int32_t g = 0; g < groups; ++g) {
      const int32_t first = base + g * kLanes;
      const uint16_t* vrows[kLanes];
      if (in_place) {
        PlaneRows(pb, t.seq, v_plane, first, kLanes, jlo, jhi, vrows);
        for (const uint16_t*& row : vrows) row = row ? row : kZeroRow;
        Defer(t.seq, v_plane, first + kAhead * kLanes, jlo, jhi);  // LoadGroup's prefetch, held back as there
      } else {
        LoadGroup(t.seq, v_plane, first, jlo, jhi, /*defer=*/!transposed);
      }
      const int64_t share = (pending_lines_ + 4 * blocks - 1) / (4 * blocks);
      for (int r0 = 0; r0 < rows; r0 += kValueRows) {
        const float* p[kValueRows];  // each row's 16 probabilities (zeros: none in this group)
        bool any = false;
        for (int k = 0; k < kValueRows; ++k) {
          const int r = r0 + k;
          const bool sees = r < rows && first <= pos_[r] && first + kLanes > lo_[r];
          p[k] = sees ? &scores_[r * width + g * kLanes] : kZeros;
          any |= sees;
        }
        if (!any) {
          Pump(4 * share);
          continue;
        }
#ifdef __AVX512F__
        if constexpr (kValuesInPlace) {
          if (in_place) {
            GroupValuesFromRows<C, kValueRows>(&acc_[r0 * chunks], p, vrows, [&] { Pump(share); });
            continue;
          }
        }
#endif
        GroupValues<C, kValueRows>(&acc_[r0 * chunks], p, group_.data(), chunks, [&] { Pump(share); });
      }
    }
    for (int r = 0; r < rows; ++r) {
      StoreRow(pb, t, r, reinterpret_cast<const float*>(&acc_[r * chunks]), 1.0f / denom_[r]);
    }
  }

 private:
  static constexpr int kAhead = 4;  // groups fetched ahead of the one being read
  static constexpr uint16_t kZeroRow[kLanes * (C > 0 ? C : 1)] = {};  // a bfloat16 row of zeros

  // Into the second-level cache (locality 2: PREFETCHT1), not the first: the first level
  // tracks few misses at once (a group ahead is 32-64 lines), so each prefetch beyond them
  // stalled until one came in, and a decode read the cache at ~9 GB/s of the 45 two cores
  // stream. From the second level the group's loads wait ~a dozen cycles, not on memory.
  // A 32-sequence decode's attention (30 layers, 264 positions; Zen 4, 2 cores) 20-23 ->
  // 14-16 ms with a bfloat16 cache, 36 -> 24-28 ms with float32; prefills the same.
  // The group at `first` all at once (Defer, then every pending line).
  JAXSERVE_PREFETCHER void Prefetch(int32_t seq, int64_t plane, int32_t first, int32_t jlo, int32_t jhi) {
    Defer(seq, plane, first, jlo, jhi);
    Pump(pending_lines_);
  }

  // A tile of few rows (a decode's) holds each group's prefetch back (Defer) and issues it a
  // share at a time between its rows' scores and inside its p * V (Pump): the group's 32-64
  // lines asked for at once stalled the core on the prefetch instructions themselves once
  // the miss queue was full (perf put ~22% of the runner's own time on them), so memory
  // and arithmetic took turns: a 32-sequence decode's attention (30 layers, 232 positions)
  // took 12.2 ms with every sequence's pages in memory against 8.8 ms with all of them
  // reading the same cached pages. Spread out: float32 cache 20.9-24.5 -> 16.1-17.7 ms,
  // bfloat16 11.5-13.0 -> 10.7-11.8 ms (Zen 4, 2 cores, 4 alternating rounds of
  // scripts/bench_attention.py); offline 32 x 200 / 64 +3.5% / +10.8% bfloat16, +5.7% /
  // +9.5% float32 (alternating pairs, the same outputs). Prefill tiles keep whole-group
  // prefetches: their arithmetic per group dwarfs the stall.
  JAXSERVE_PREFETCHER void Defer(int32_t seq, int64_t plane, int32_t first, int32_t jlo, int32_t jhi) {
    Pump(pending_lines_);
    const int64_t row_bytes = pb_.head_dim * static_cast<int64_t>(sizeof(T));
    PageRuns(pb_, seq, plane, std::max(first, jlo), std::min(first + kLanes, jhi), [&](int64_t row, int32_t, int32_t n) {
      const char* bytes = reinterpret_cast<const char*>(static_cast<const T*>(pb_.kv) + row * pb_.head_dim);
      if (num_pending_ == kMaxPending) Pump(pending_lines_);  // more runs than slots (pages of < 4 tokens)
      const int64_t lines = (n * row_bytes + 63) / 64;
      pending_[num_pending_++] = {bytes, lines};
      pending_lines_ += lines;
    });
  }
  JAXSERVE_PREFETCHER void Pump(int64_t lines) {
    while (lines > 0 && num_pending_ > 0) {
      Pending& run = pending_[num_pending_ - 1];
      const int64_t n = std::min(lines, run.lines);
      for (int64_t i = 0; i < n; ++i) __builtin_prefetch(run.next + 64 * i, 0, 2);
      run.next += 64 * n;
      run.lines -= n;
      lines -= n;
      pending_lines_ -= n;
      if (run.lines == 0) --num_pending_;
    }
  }
  struct Pending {
    const char* next;
    int64_t lines;
  };
  static constexpr int kMaxPending = 4;
  Pending pending_[kMaxPending];
  int num_pending_ = 0;
  int64_t pending_lines_ = 0;

  // GroupScoresTransposed of rows [r0, r0 + n) (n <= kScoreRows) against keys_ into out.
  void ScoreRows(int r0, int n, float* out, int64_t width) const {
    const int64_t chunks = C > 0 ? C : (pb_.head_dim + kLanes - 1) / kLanes;
    const float* q[kScoreRows];
    for (int r = 0; r < n; ++r) q[r] = reinterpret_cast<const float*>(&qs_[(r0 + r) * chunks]);
    const float* keys = reinterpret_cast<const float*>(keys_.data());
#ifdef __AVX512F__
    switch (n) {
      case 1: return GroupScoresTransposed<Lanes, C, 1>(q, keys, chunks, out, width);
      case 2: return GroupScoresTransposed<Lanes, C, 2>(q, keys, chunks, out, width);
      case 3: return GroupScoresTransposed<Lanes, C, 3>(q, keys, chunks, out, width);
      default: return GroupScoresTransposed<Lanes, C, kScoreRows>(q, keys, chunks, out, width);
    }
#else
    for (int h = 0; h < 2; ++h) {  // GroupScores' halves: keys 0-7, then 8-15
      if (n == 1) {
        GroupScoresTransposed<Lanes8, C, 1>(q, keys + 8 * h, chunks, out + 8 * h, width);
      } else {
        GroupScoresTransposed<Lanes8, C, kScoreRows>(q, keys + 8 * h, chunks, out + 8 * h, width);
      }
    }
#endif
  }

  // The K rows of positions [first, first + 16) into keys_, transposed: keys_[d] holds
  // dimension d of the 16 keys as float32, zero for rows outside [jlo, jhi) and past
  // head_dim. A bfloat16 cache with AVX-512 goes straight from its rows: a 16 x 16
  // transpose of 32-bit pairs of dimensions, each pair's halves then widened (exactly as
  // ToFloat widens them), instead of widening 16 x head_dim values and transposing those.
  void LoadKeys(int32_t seq, int64_t plane, int32_t first, int32_t jlo, int32_t jhi) {
#ifdef __AVX512F__
    if constexpr (std::is_same_v<T, uint16_t> && C > 0 && C % 2 == 0) {
      Prefetch(seq, plane, first + kAhead * kLanes, jlo, jhi);
      const uint16_t* rows[kLanes];
      PlaneRows(pb_, seq, plane, first, kLanes, jlo, jhi, rows);
      const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
      float* out = reinterpret_cast<float*>(keys_.data());
      for (int c = 0; c < C / 2; ++c) {  // 32 dimensions: 16 pairs
        __m512i x[kLanes];
        for (int j = 0; j < kLanes; ++j) x[j] = rows[j] ? _mm512_loadu_si512(rows[j] + 32 * c) : _mm512_setzero_si512();
        Transpose16x16(x);  // x[p]: dimensions 2p (low half) and 2p + 1 of every key
        for (int p = 0; p < kLanes; ++p) {
          _mm512_storeu_si512(out + (32 * c + 2 * p) * kLanes, _mm512_slli_epi32(x[p], 16));
          _mm512_storeu_si512(out + (32 * c + 2 * p + 1) * kLanes, _mm512_and_si512(x[p], high));
        }
      }
      return;
    }
#endif
    LoadGroup(seq, plane, first, jlo, jhi);
    const int64_t chunks = C > 0 ? C : (pb_.head_dim + kLanes - 1) / kLanes;
    TransposeKeys(reinterpret_cast<const float*>(group_.data()), chunks * kLanes, keys_.data());
  }

  // K or V rows of positions [first, first + 16) as float32 chunks into group_; rows
  // outside [jlo, jhi) (not this tile's to read) and lanes past head_dim are zero.
  void LoadGroup(int32_t seq, int64_t plane, int32_t first, int32_t jlo, int32_t jhi, bool defer = false) {
    const Problem& pb = pb_;
    const int64_t D = pb.head_dim;
    Defer(seq, plane, first + kAhead * kLanes, jlo, jhi);
    if (!defer) Pump(pending_lines_);
    const int64_t chunks = C > 0 ? C : (D + kLanes - 1) / kLanes;
    int64_t rows[kLanes];  // cache rows; -1 outside [jlo, jhi)
    for (int j = 0; j < kLanes; ++j) rows[j] = -1;
    PageRuns(pb, seq, plane, std::max(first, jlo), std::min(first + kLanes, jhi), [&](int64_t row, int32_t position, int32_t n) {
      for (int32_t i = 0; i < n; ++i) rows[position - first + i] = row + i;
    });
    for (int j = 0; j < kLanes; ++j) {
      Lanes* dst = &group_[j * chunks];
      if (rows[j] < 0) {
        for (int64_t c = 0; c < chunks; ++c) dst[c] = Lanes{};
        continue;
      }
      const T* x = static_cast<const T*>(pb.kv) + rows[j] * D;
      if constexpr (C > 0 && std::is_same_v<T, float>) {
        // A copy (on AVX2 GCC's 16-lane loads and stores went through the stack 16 bytes
        // at a time: a 32-sequence decode's attention 34-39 -> 32-36 ms on a Zen 3).
        std::memcpy(dst, x, C * sizeof(Lanes));
#if defined(__AVX2__) && !defined(__AVX512F__)
      } else if constexpr (C > 0 && std::is_same_v<T, uint16_t>) {
        // LoadLanes' widening, 8 at a time: 64 decodes at 300 positions over a bfloat16
        // cache, 30 layers, 73-78 -> 61-68 ms on a Zen 3 (scripts/bench_attention.py).
        for (int h = 0; h < 2 * C; ++h) {
          const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * h));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst) + h, _mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
        }
#endif
      } else if constexpr (C > 0) {
        for (int c = 0; c < C; ++c) dst[c] = LoadLanes(x + c * kLanes);
      } else {
        float* f = reinterpret_cast<float*>(dst);
        for (int64_t d = 0; d < chunks * kLanes; ++d) f[d] = d < D ? ToFloat(x[d]) : 0.0f;
      }
      if constexpr (kScaled<T>) {
        const float scale = pb.scales[rows[j]];
        for (int64_t c = 0; c < chunks; ++c) dst[c] *= scale;
      }
    }
  }

  const Problem& pb_;
  std::vector<int32_t> pos_, lo_;
  std::vector<Lanes> qs_, group_, keys_, acc_;  // [rows, chunks], [16, chunks], [chunks * 16], [rows, chunks]
  std::vector<float> scores_, denom_;
};

}  // namespace

#endif  // JAXSERVE_RAGGED_PAGED_ATTENTION_CPU_TILE_RUNNER_H_
