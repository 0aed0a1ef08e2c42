// AmxTileRunner: one tile of the CPU attention kernel on AMX (a bfloat16 cache), where
// the library is built for a CPU with AMX (JAXSERVE_HAVE_AMX, cpu_amx.h).
// Part of the CPU attention kernel, cpu_kernel.cc (whose header comment states the
// contract), included there only.

#ifndef JAXSERVE_RAGGED_PAGED_ATTENTION_CPU_AMX_TILE_RUNNER_H_
#define JAXSERVE_RAGGED_PAGED_ATTENTION_CPU_AMX_TILE_RUNNER_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pallas_kernels/cpu_amx.h"
#include "pallas_kernels/ragged_paged_attention/cpu_row_math.h"
#include "pallas_kernels/ragged_paged_attention/cpu_tile.h"

// Internal linkage, as when all of it was one file: these headers are included into
// cpu_kernel.cc alone.
namespace {

#ifdef JAXSERVE_HAVE_AMX
// The same tiles on AMX, for a bfloat16 cache and a head_dim that is a multiple of 32: the
// two products run as bfloat16 tile products with float32 accumulation, the softmax as in
// TileRunner. The float32 operands (the scaled query, the probabilities) go in as
// bfloat16 hi + lo pairs (SplitBf16), so the result stays within ~1e-5 of float32
// arithmetic on the same bfloat16 K and V (the tests hold it to 2e-5). A 500-token
// prefill in one SmolLM2 layer: ~1.0 ms against the vector path's ~1.8 (2-core Xeon).
//
// Rows stay independent: a tile product's element depends only on its own row of the
// left operand, its column of the right one and its accumulator, so a row's scores and
// output are the same in any tile, padded to 16 rows or not. Blocks of positions start at
// multiples of 16 (scores) and 32 (p * V) from position 0, positions a row does not see
// have probability 0 and add an exact zero, and every row is computed this way (decodes
// too), so a token's output is bit-identical however it was batched.
class AmxTileRunner {
 public:
  explicit AmxTileRunner(const Problem& pb) : pb_(pb) {}

  void Run(const Tile& t) {
    const Problem& pb = pb_;
    const int64_t D = pb.head_dim, G = pb.num_heads / pb.num_kv_heads;
    const int rows = t.num_tokens * static_cast<int>(G);
    const int padded = (rows + 15) / 16 * 16;

    // Rows: position, lowest visible position, scaled query as hi + lo. Padding rows (to
    // 16) are left as they are: a tile product's row depends only on its own row of the
    // left operand, so they reach only padding rows of the results.
    q_hi_.resize(static_cast<size_t>(padded) * D);
    q_lo_.resize(static_cast<size_t>(padded) * D);
    const __m512 scale = _mm512_set1_ps(pb.sm_scale);
    TileRows(pb, t, pos_, lo_, [&](int r, const float* q) {
      for (int64_t d = 0; d < D; d += 16) {
        jaxserve::SplitBf16(_mm512_mul_ps(_mm512_loadu_ps(q + d), scale), &q_hi_[r * D + d], &q_lo_[r * D + d]);
      }
    });
    const int32_t jlo = lo_[0], jhi = pos_[rows - 1] + 1;  // the positions the tile reads
    const int32_t base = jlo - jlo % 32;
    const int32_t blocks = (jhi - base + 31) / 32;  // of 32 positions: two score groups each
    const int64_t width = static_cast<int64_t>(blocks) * 32;

    // A block of 16 rows reads the positions from its first row's lo to its last row's pos.
    auto row_range = [&](int r0) {
      const int last = std::min(r0 + 15, rows - 1);
      return std::pair<int32_t, int32_t>{lo_[r0] - base, pos_[last] - base};
    };

    // 1. Scores: per 16 rows and 16 positions, sum over head_dim in 32s of q_hi.K + q_lo.K.
    // The values' rows are fetched meanwhile, for step 3.
    const int64_t chunks = D / 32;
    const int64_t v_plane = pb.num_kv_heads + t.kv_head;
    scores_.resize(static_cast<size_t>(padded) * width);
    if (rows <= 16 && chunks <= 2 && pb.page_size % 16 == 0) {
      // One block of rows (a decode): the scores transposed, K . q^T, with K's tiles read
      // straight from its pages (a group of 16 positions is 16 rows of one page) and q^T
      // made once, instead of transposing every group of keys. A product's element is the
      // same either way round (the same bfloat16 pairs in the same order; the tests check
      // a decode against the same token in a prefill chunk). A group's keys outside
      // [jlo, jhi) only reach that position's scores, which the softmax masks.
      const auto [from, to] = row_range(0);
      for (int64_t c = 0; c < chunks; ++c) {
        for (int part = 0; part < 2; ++part) {
          const uint16_t* q = (part ? q_lo_ : q_hi_).data() + c * 32;
          __m512i x[16];
          for (int n = 0; n < 16; ++n) x[n] = _mm512_loadu_si512(q + n * D);
          Transpose16x16(x);
          for (int k = 0; k < 16; ++k) _mm512_storeu_si512(&q_t_[((c * 2 + part) * 16 + k) * 32], x[k]);
        }
      }
      _tile_loadd(2, &q_t_[0], 64);
      _tile_loadd(3, &q_t_[512], 64);
      if (chunks == 2) {
        _tile_loadd(4, &q_t_[1024], 64);
        _tile_loadd(5, &q_t_[1536], 64);
      }
      // Two groups at a time, each in its own accumulator (tiles 0 and 1), so that a
      // product need not wait for the sum before it (one group's four chained products
      // took ~30% of a decode's attention); each still adds hi then lo, chunk by chunk.
      const int32_t g_first = from / 16, g_last = to / 16;
      for (int32_t g = g_first; g < std::min(g_last + 1, g_first + kAhead); ++g) {
        Prefetch(t.seq, t.kv_head, base + g * 16, jlo, jhi);
      }
      alignas(64) float transposed[2][256];
      for (int32_t g = g_first; g <= g_last; g += 2) {
        const int n = std::min(2, g_last - g + 1);  // groups in this round
        for (int i = 0; i < n; ++i) {
          Prefetch(t.seq, t.kv_head, base + (g + i + kAhead) * 16, jlo, jhi);
          Prefetch<1>(t.seq, v_plane, base + (g + i) * 16, jlo, jhi);
        }
        const uint16_t* k0 = PageRow(t.seq, t.kv_head, base + g * 16);
        const uint16_t* k1 = n == 2 ? PageRow(t.seq, t.kv_head, base + (g + 1) * 16) : nullptr;
        _tile_zero(0);
        if (n == 2) _tile_zero(1);
        for (int64_t c = 0; c < chunks; ++c) {
          _tile_loadd(6, k0 + c * 32, D * 2);
          if (n == 2) _tile_loadd(7, k1 + c * 32, D * 2);
          if (c == 0) {
            _tile_dpbf16ps(0, 6, 2);
            if (n == 2) _tile_dpbf16ps(1, 7, 2);
            _tile_dpbf16ps(0, 6, 3);
            if (n == 2) _tile_dpbf16ps(1, 7, 3);
          } else {
            _tile_dpbf16ps(0, 6, 4);
            if (n == 2) _tile_dpbf16ps(1, 7, 4);
            _tile_dpbf16ps(0, 6, 5);
            if (n == 2) _tile_dpbf16ps(1, 7, 5);
          }
        }
        _tile_stored(0, transposed[0], 64);
        if (n == 2) _tile_stored(1, transposed[1], 64);
        for (int i = 0; i < n; ++i) {
          __m512i x[16];
          for (int j = 0; j < 16; ++j) x[j] = _mm512_load_si512(transposed[i] + j * 16);
          Transpose16x16(x);
          for (int r = 0; r < rows; ++r) _mm512_storeu_si512(&scores_[r * width + (g + i) * 16], x[r]);
        }
      }
    } else {
      LoadKeys(t, base, blocks, jlo, jhi, [&](int32_t g) { Prefetch<1>(t.seq, v_plane, base + g * 16, jlo, jhi); });
      for (int r0 = 0; r0 < rows; r0 += 16) {
        const auto [from, to] = row_range(r0);
        for (int32_t g = from / 16; g <= to / 16; g += 4) {
          switch (std::min<int32_t>(4, to / 16 - g + 1)) {
            case 1: ScoreGroups<1>(r0, g, width); break;
            case 2: ScoreGroups<2>(r0, g, width); break;
            case 3: ScoreGroups<3>(r0, g, width); break;
            default: ScoreGroups<4>(r0, g, width);
          }
        }
      }
    }

    // 2. Softmax per row, its probabilities stored as hi + lo, and zeros in the rest of
    // its 16-row block's range.
    denom_.resize(rows);
    p_hi_.resize(static_cast<size_t>(padded) * width);
    p_lo_.resize(static_cast<size_t>(padded) * width);
    for (int r = 0; r < rows; ++r) {
      const auto [from, to] = row_range(r / 16 * 16);
      uint16_t *hi = &p_hi_[r * width], *lo = &p_lo_[r * width];
      denom_[r] = SoftmaxRow(&scores_[r * width], base, lo_[r], pos_[r], [hi, lo](int32_t g, Lanes p) {
        __m512 x;
        std::memcpy(&x, &p, sizeof x);
        jaxserve::SplitBf16(x, hi + g * 16, lo + g * 16);
      });
      const int32_t g_lo = (lo_[r] - base) / 16, g_hi = (pos_[r] - base) / 16;
      auto zero = [hi, lo](int32_t g) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + g * 16), _mm256_setzero_si256());
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + g * 16), _mm256_setzero_si256());
      };
      for (int32_t g = from / 32 * 2; g < g_lo; ++g) zero(g);  // whole blocks of 32 positions
      for (int32_t g = g_hi + 1; g <= to / 32 * 2 + 1; ++g) zero(g);
    }

    // 3. Output: per 16 rows and 16 of head_dim, sum over blocks of 32 positions, in
    // ascending order, of p_hi.V + p_lo.V; four accumulators (64 of head_dim) at a time.
    // A tile of one block of rows (a decode) packs each block's values just before its
    // products, into a buffer that stays in the first-level cache; packed all at once
    // (~36 KB at head_dim 64), they had left for the second level before the products
    // read them: the packing's stores drew ~27% of the kernel's samples in a 32-sequence
    // decode whose pages were all in cache.
    const bool block_by_block = padded == 16;
    if (!block_by_block) LoadValues(t, base, blocks, jlo, jhi);
    acc_.resize(static_cast<size_t>(padded) * D);
    const int64_t columns = D / 16;
    for (int r0 = 0; r0 < rows; r0 += 16) {
      const auto [from, to] = row_range(r0);
      for (int64_t c0 = 0; c0 < columns; c0 += 4) {
        const int64_t n = std::min<int64_t>(4, columns - c0);  // 2 or 4 (head_dim % 32 == 0)
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        // The value tiles alternate between 6 and 7, so each product finds its operand
        // loaded while the one before still runs; every accumulator still adds its
        // block's hi then lo product, block by block.
        for (int32_t b = from / 32; b <= to / 32; ++b) {
          if (block_by_block) PackValues(t, base + b * 32, jlo, jhi, c0 * 16, n, block_.data());
          const uint16_t* v = block_by_block ? block_.data() : &values_[(b * columns + c0) * 512];
          _tile_loadd(4, &p_hi_[r0 * width + b * 32], width * 2);
          _tile_loadd(5, &p_lo_[r0 * width + b * 32], width * 2);
          _tile_loadd(6, v, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, v + 512, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(0, 5, 6);
          _tile_dpbf16ps(1, 5, 7);
          if (n == 4) {
            _tile_loadd(6, v + 1024, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, v + 1536, 64);
            _tile_dpbf16ps(3, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        float* acc = &acc_[r0 * D + c0 * 16];
        _tile_stored(0, acc, D * 4);
        _tile_stored(1, acc + 16, D * 4);
        if (n == 4) {
          _tile_stored(2, acc + 32, D * 4);
          _tile_stored(3, acc + 48, D * 4);
        }
      }
    }
    for (int r = 0; r < rows; ++r) {
      Unpermute(&acc_[r * D], D);
      StoreRow(pb, t, r, &acc_[r * D], 1.0f / denom_[r]);
    }
  }

 private:
  // Scores of the 16 rows from r0 against N (1-4) groups of 16 positions from g, summed
  // over head_dim in chunks of 32: each group in its own accumulator (tiles 0 to N - 1),
  // so that consecutive tile products do not wait for each other's sums (one accumulator
  // took ~3x as long: each product waited for the last); per chunk the query's hi and lo
  // (tiles 4, 5) and the groups' keys (6 and 7 in turn). Each accumulator adds the same
  // products in the same order as a group alone: chunk by chunk, hi then lo.
  template <int N>
  void ScoreGroups(int r0, int32_t g, int64_t width) {
    const int64_t D = pb_.head_dim, chunks = D / 32, step = chunks * 512;  // keys_ per group
    _tile_zero(0);
    if constexpr (N > 1) _tile_zero(1);
    if constexpr (N > 2) _tile_zero(2);
    if constexpr (N > 3) _tile_zero(3);
    for (int64_t c = 0; c < chunks; ++c) {
      const uint16_t* k = &keys_[(g * chunks + c) * 512];
      _tile_loadd(4, &q_hi_[r0 * D + c * 32], D * 2);
      _tile_loadd(5, &q_lo_[r0 * D + c * 32], D * 2);
      _tile_loadd(6, k, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (N > 1) {
        _tile_loadd(7, k + step, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      _tile_dpbf16ps(0, 5, 6);
      if constexpr (N > 1) _tile_dpbf16ps(1, 5, 7);
      if constexpr (N > 2) {
        _tile_loadd(6, k + 2 * step, 64);
        _tile_dpbf16ps(2, 4, 6);
      }
      if constexpr (N > 3) {
        _tile_loadd(7, k + 3 * step, 64);
        _tile_dpbf16ps(3, 4, 7);
      }
      if constexpr (N > 2) _tile_dpbf16ps(2, 5, 6);
      if constexpr (N > 3) _tile_dpbf16ps(3, 5, 7);
    }
    float* out = &scores_[r0 * width + g * 16];
    _tile_stored(0, out, width * 4);
    if constexpr (N > 1) _tile_stored(1, out + 16, width * 4);
    if constexpr (N > 2) _tile_stored(2, out + 32, width * 4);
    if constexpr (N > 3) _tile_stored(3, out + 48, width * 4);
  }

  const uint16_t* Kv() const { return static_cast<const uint16_t*>(pb_.kv); }
  const uint16_t* PageRow(int32_t seq, int64_t plane, int32_t position) const {
    const Problem& pb = pb_;
    const int64_t page = pb.page_table[seq * pb.pages_per_seq + position / pb.page_size];
    return Kv() + CacheRow(pb, plane, page, position % pb.page_size) * pb.head_dim;
  }

  static constexpr int kAhead = 4;  // groups of 16 positions fetched ahead of the one read

  // The rows of positions [first, first + 16) of a K or V plane into the caches: the
  // first level for rows read next (Level 3), the second for rows read after the softmax
  // (Level 1: the first level's few miss buffers stay free for the keys).
  template <int Level = 3>
  JAXSERVE_PREFETCHER void Prefetch(int32_t seq, int64_t plane, int32_t first, int32_t jlo, int32_t jhi) const {
    const int64_t row_bytes = pb_.head_dim * 2;
    PageRuns(pb_, seq, plane, std::max(first, jlo), std::min(first + 16, jhi), [&](int64_t row, int32_t, int32_t n) {
      const char* bytes = reinterpret_cast<const char*>(Kv() + row * pb_.head_dim);
      for (int64_t byte = 0; byte < n * row_bytes; byte += 64) __builtin_prefetch(bytes + byte, 0, Level);
    });
  }

  // What keys_ or values_ hold: the packing of positions [base, jhi) of one sequence's KV
  // head for tiles whose lowest visible position is jlo, zeros from jhi on.
  struct Packed {
    int32_t seq = -1, kv_head = -1, jlo = -1, jhi = 0;
    // The first position to pack for the tile (t, jlo, jhi), whose first group or block
    // starts at base: where this buffer's packing stops being the tile's, rounded down to
    // `size` positions (its group or block that was part zeros), or base for another
    // sequence, head or window. A call's tiles come in ascending order of their tokens, so
    // a runner's next tile of the same sequence and head reads the same positions and more:
    // packing every tile's whole range again (a 500-token prefill's 24 tiles per head read
    // 250 positions each on average) is what this spares: its 30 layers' attention 27.6-32.2
    // -> 25.4-26.0 ms (2-core AMX Xeon, 3 alternating pairs). Same bytes, same products.
    int32_t From(const Tile& t, int32_t base, int32_t tile_jlo, int32_t tile_jhi, int32_t size) const {
      if (seq != t.seq || kv_head != t.kv_head || jlo != tile_jlo || jhi > tile_jhi) return base;
      return base + (jhi - base) / size * size;
    }
    void Set(const Tile& t, int32_t tile_jlo, int32_t tile_jhi) { *this = {t.seq, t.kv_head, tile_jlo, tile_jhi}; }
  };

  // keys_[group of 16 positions][head_dim / 32][16 pair rows][16 positions][2]: the right
  // operand of q . K^T, row k holding dimensions 2k, 2k + 1 of each position (a 16 x 16
  // transpose of 32-bit pairs), the groups an earlier tile packed kept (Packed).
  // Calls loaded(g) after group g is in.
  template <typename Loaded>
  void LoadKeys(const Tile& t, int32_t base, int32_t blocks, int32_t jlo, int32_t jhi, Loaded&& loaded) {
    const int64_t D = pb_.head_dim, chunks = D / 32;
    const int32_t from = (packed_keys_.From(t, base, jlo, jhi, 16) - base) / 16;
    keys_.resize(static_cast<size_t>(blocks) * 2 * chunks * 512);
    for (int32_t g = from; g < std::min(blocks * 2, from + kAhead); ++g) Prefetch(t.seq, t.kv_head, base + g * 16, jlo, jhi);
    for (int32_t g = from; g < blocks * 2; ++g) {
      Prefetch(t.seq, t.kv_head, base + (g + kAhead) * 16, jlo, jhi);
      const uint16_t* k[16];
      PlaneRows(pb_, t.seq, t.kv_head, base + g * 16, 16, jlo, jhi, k);
      for (int64_t c = 0; c < chunks; ++c) {
        __m512i x[16];
        for (int n = 0; n < 16; ++n) x[n] = k[n] ? _mm512_loadu_si512(k[n] + c * 32) : _mm512_setzero_si512();
        Transpose16x16(x);
        __m512i* dst = reinterpret_cast<__m512i*>(&keys_[(g * chunks + c) * 512]);
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p, x[p]);
      }
      loaded(g);
    }
    packed_keys_.Set(t, jlo, jhi);
  }

  // The right operand of p . V for the 32 positions from `first` and `columns` (an even
  // number) of 16 dimensions from dimension d0, into out[column][16 pair rows][16
  // dimensions][2]: row k holds positions 2k, 2k + 1 of each dimension. Per 32 dimensions,
  // an even and an odd position's words are interleaved within 128-bit lanes (vpunpcklwd /
  // vpunpckhwd: a third of the instructions of widening each and merging), which leaves
  // column 2h with dimensions d0 + 32h + {0-3, 8-11, 16-19, 24-27} and column 2h + 1 with
  // the others: the output's columns come out in that order and Unpermute puts them back.
  // A column's products and their order are the same in any order of columns.
  void PackValues(const Tile& t, int32_t first, int32_t jlo, int32_t jhi, int64_t d0, int64_t columns,
                  uint16_t* out) const {
    const uint16_t* v[32];
    PlaneRows(pb_, t.seq, pb_.num_kv_heads + t.kv_head, first, 32, jlo, jhi, v);
    const __m512i zero = _mm512_setzero_si512();
    for (int k = 0; k < 16; ++k) {
      const uint16_t *even = v[2 * k], *odd = v[2 * k + 1];
      for (int64_t h = 0; h < columns / 2; ++h) {
        const __m512i e = even ? _mm512_loadu_si512(even + d0 + h * 32) : zero;
        const __m512i o = odd ? _mm512_loadu_si512(odd + d0 + h * 32) : zero;
        uint16_t* dst = out + (2 * h * 16 + k) * 32;
        _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(e, o));
        _mm512_storeu_si512(dst + 512, _mm512_unpackhi_epi16(e, o));
      }
    }
  }

  // values_[block of 32 positions][head_dim / 16][16 pair rows][16 dimensions][2]: every
  // block's PackValues, the blocks an earlier tile packed kept (Packed).
  void LoadValues(const Tile& t, int32_t base, int32_t blocks, int32_t jlo, int32_t jhi) {
    const int64_t columns = pb_.head_dim / 16;
    const int32_t from = (packed_values_.From(t, base, jlo, jhi, 32) - base) / 32;
    values_.resize(static_cast<size_t>(blocks) * columns * 512);
    for (int32_t b = from; b < blocks; ++b) PackValues(t, base + b * 32, jlo, jhi, 0, columns, &values_[b * columns * 512]);
    packed_values_.Set(t, jlo, jhi);
  }

  // A row of the p . V product (D floats, its columns in PackValues' order) put in order.
  static void Unpermute(float* acc, int64_t D) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t d = 0; d < D; d += 32) {
      const __m512 a = _mm512_loadu_ps(acc + d), b = _mm512_loadu_ps(acc + d + 16);
      _mm512_storeu_ps(acc + d, _mm512_permutex2var_ps(a, lo, b));
      _mm512_storeu_ps(acc + d + 16, _mm512_permutex2var_ps(a, hi, b));
    }
  }

  const Problem& pb_;
  std::vector<int32_t> pos_, lo_;
  std::vector<uint16_t> q_hi_, q_lo_, p_hi_, p_lo_, keys_, values_;
  Packed packed_keys_, packed_values_;  // what keys_ and values_ hold
  std::vector<uint16_t> q_t_ = std::vector<uint16_t>(4 * 512);  // q^T as hi, lo per 32 of head_dim
  std::vector<uint16_t> block_ = std::vector<uint16_t>(4 * 512);  // PackValues of 4 columns
  std::vector<float> scores_, denom_, acc_;
};

#endif  // JAXSERVE_HAVE_AMX

}  // namespace

#endif  // JAXSERVE_RAGGED_PAGED_ATTENTION_CPU_AMX_TILE_RUNNER_H_
