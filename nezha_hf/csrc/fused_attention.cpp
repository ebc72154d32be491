// NEZHA relative-position attention as one fused CPU kernel, forward and backward, in float32, bfloat16 and float16.
//
// The maths is `nezha_hf/relative_attention.py`'s (see its module docstring):
//     s_ij  = (q_i . k_j + q_i . T[r(i, j)]) * scale + mask,   r(i, j) = clip(j - i, -K, K) + K
//     out_i = sum_j p_ij (v_j + T[r(i, j)])
// computed like flash attention: query blocks against key blocks with an online softmax, so
// memory stays linear in the length. The relative key term is a lookup in `qt = scale * q T^T`
// (per query row, 2K + 1 numbers); the value term is accumulated as probability mass per table
// row (`bucket`, 2K + 1 numbers per query row) and added as `bucket @ T` at the end. In a key
// block each query row splits into at most three contiguous column ranges: the left tail (row 0),
// the band (rows 1 .. 2K - 1) and the right tail (row 2K).
//
// Queries sit at positions `offset .. offset + Lq - 1` against keys `0 .. Lk - 1` (with a KV cache
// the queries are the new tokens). Attention dropout multiplies p_ij by keep_ij / (1 - p) in both
// value terms; keep_ij comes from a counter-based hash of (seed, batch * heads + head, i, j), so the
// backward regenerates the forward's mask instead of storing it (`Problem::row_key` and `keep_factor` are the
// definition; tests re-derive it independently).
//
// The block products (q k^T, p v and those of the backward) go to the routines PyTorch's own CPU flash attention
// uses, chosen per call by `products_for`:
// - float32: `cpublas::brgemm` on float32 blocks (oneDNN's micro-kernel).
// - bfloat16 / float16 where the CPU multiplies that type itself: the products take the reduced-precision blocks with
//   float32 accumulation through `cpublas::brgemm` on packed B operands (`Packed`): keys and values once per call, the
//   query blocks and their output gradients once per block. Where oneDNN has tile instructions for the type
//   (`cpublas::could_pack`: AMX, e.g. every Xeon since Sapphire Rapids) and for bfloat16 on a CPU with AVX512-BF16 but
//   no AMX (`bfloat16_pairs_multiply`: AMD Zen 4 and later, Cooper Lake; its `vdpbf16ps` products, about twice
//   float32's speed: benchmarks/results/avx512-bf16/attention-bfloat16.md), the operands are packed here, straight
//   from the source rows, into the rows-in-pairs layout both read ([K / 2, N, 2], as PyTorch's own kernel packs them),
//   keys in panels as wide as a key block so that one brgemm call multiplies a whole block. Scores, softmax, the
//   relative terms and every accumulator stay float32; only the probabilities (and their gradients) are rounded to
//   the input type before their products, as in PyTorch's kernel.
// - bfloat16 / float16 elsewhere (float16 without AMX-FP16, any type with oneDNN switched off, CPUs without either):
//   converted to float32 and computed as float32.
// Which one ran is counted (`routine_calls`), so tests can tell. If this file does not build or load, the loader in
// fused_attention.py says so and the engines after this one in the chain take its calls (docs/attention.md's table).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(_MSC_VER) && (defined(_M_X64) || defined(_M_IX86)))
#include <immintrin.h>
#endif

namespace {

namespace cpublas = at::native::cpublas;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// --- the block products -----------------------------------------------------------------------------------------

// The routine that multiplies a call's blocks (see the header), and how many calls each has run.
enum Routine : int { kFloat32 = 0, kReducedPacked = 1, kRoutines = 2 };
constexpr std::array<const char*, kRoutines> kRoutineNames = {"float32", "reduced-precision packed"};
std::array<std::atomic<int64_t>, kRoutines> routine_counts{};

bool is_reduced(at::ScalarType type) { return type == at::kBFloat16 || type == at::kHalf; }

// Whether oneDNN's brgemm multiplies bfloat16 blocks here without AMX: the CPU has AVX512-BF16 (its pair products,
// `vdpbf16ps`; asked at run time, since oneDNN generates its own code whatever flags compiled this file), oneDNN is
// switched on, and a 1 x 16 x 2 product in the pair layout came out right the first time (PyTorch builds without
// oneDNN's micro-kernels refuse it).
bool bfloat16_pairs_multiply() {
  if (!at::globalContext().userEnabledMkldnn()) return false;
  static const bool works = [] {
    const auto capabilities = at::cpu::get_cpu_capabilities();
    const auto flag = capabilities.find("avx512_bf16");
    if (flag == capabilities.end() || !flag->second.toBool()) return false;
    try {
      const std::array<at::BFloat16, 2> a = {1.0f, 2.0f};
      std::array<at::BFloat16, 32> b;  // B[k][n] = (1, n) at b[2 n + k]
      for (int n = 0; n < 16; ++n) b[2 * n] = 1.0f, b[2 * n + 1] = static_cast<float>(n);
      std::array<float, 16> c{};
      cpublas::brgemm(1, 16, 2, 2, 16, 16, false, a.data(), b.data(), c.data(), true);
      cpublas::brgemm_release();
      for (int n = 0; n < 16; ++n)
        if (c[n] != 1.0f + 2.0f * n) return false;
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return works;
}

Routine products_for(at::ScalarType type) {
  if (!is_reduced(type)) return kFloat32;
  return cpublas::could_pack(type) || (type == at::kBFloat16 && bfloat16_pairs_multiply()) ? kReducedPacked : kFloat32;
}

// Row-major C[M, N] = A[M, K] @ B[K, N] (+ C when `accumulate`), float32, with leading dimensions (row strides):
// PyTorch's own micro-kernel for its CPU flash attention, about 30% faster than BLAS sgemm on these block sizes. It
// takes no transposes, so keys and values are transposed once per call where a product needs them that way.
inline void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc, bool accumulate) {
  if (M > 0 && N > 0) cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, false);
}

// Columns per packed panel of a block of rows (`row_block`), and what key blocks and row strides are rounded to.
constexpr int64_t kPanel = 64;
inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }
inline int64_t even(int64_t x) { return x + (x & 1); }
// The width of the panel starting at column j of N in panels of `panel` columns (a multiple of 16): `panel`, or what
// is left rounded up to 16.
inline int64_t panel_width(int64_t N, int64_t j, int64_t panel) { return round_up(std::min(panel, N - j), 16); }

// A vector whose storage starts on a cache line, for the blocks the products load and store: a tile row (64 bytes)
// that straddles two lines is two loads, and glibc's malloc gives 16-byte alignment (large blocks: a page plus 16).
template <typename T>
struct LineAligned {
  using value_type = T;
  static constexpr std::align_val_t alignment{64};
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), alignment)); }
  void deallocate(T* data, std::size_t) { ::operator delete(data, alignment); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <typename T>
using Buffer = std::vector<T, LineAligned<T>>;

template <typename T>
at::ScalarType type_of() {
  return std::is_same_v<T, at::BFloat16> ? at::kBFloat16 : at::kHalf;
}

// How many rows ahead packing and decoding ask for the rows they read next: consecutive rows of one head lie heads x
// head size apart (3 KB in a base model), too far for the CPU's own stride prefetcher to follow. 16 was the fastest of
// 4, 8, 16 and 32 for a base model's decoding step over 8,192 cached keys (benchmarks/attention_parts.py times one).
constexpr int64_t kPrefetchRows = 16;

// Asks the cache for the `bytes` from `address` (a hint: it never faults; nothing where the compiler has no way to ask).
inline void prefetch(const void* address, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(static_cast<const char*>(address) + offset);
#elif defined(_M_X64) || defined(_M_IX86)  // MSVC on x86
    _mm_prefetch(static_cast<const char*>(address) + offset, _MM_HINT_T0);
#endif
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define NEZHA_AVX512_PACKING 1
// 16 rows of 16 32-bit words, transposed in registers: rows[i] word w becomes rows[w] word i.
inline void transpose_16x16_words(__m512i rows[16]) {
  __m512i columns[16];  // per 128-bit lane: group g's word j, j + 4, j + 8, j + 12 of rows 4g..4g+3, in columns[4g + j]
  for (int g = 0; g < 4; ++g) {
    const __m512i* r = rows + 4 * g;
    const __m512i low01 = _mm512_unpacklo_epi32(r[0], r[1]), high01 = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i low23 = _mm512_unpacklo_epi32(r[2], r[3]), high23 = _mm512_unpackhi_epi32(r[2], r[3]);
    columns[4 * g] = _mm512_unpacklo_epi64(low01, low23);
    columns[4 * g + 1] = _mm512_unpackhi_epi64(low01, low23);
    columns[4 * g + 2] = _mm512_unpacklo_epi64(high01, high23);
    columns[4 * g + 3] = _mm512_unpackhi_epi64(high01, high23);
  }
  for (int j = 0; j < 4; ++j) {  // gather lane l of the four groups: word 4 l + j of every row
    const __m512i groups01_low = _mm512_shuffle_i32x4(columns[j], columns[4 + j], 0x44);
    const __m512i groups01_high = _mm512_shuffle_i32x4(columns[j], columns[4 + j], 0xee);
    const __m512i groups23_low = _mm512_shuffle_i32x4(columns[8 + j], columns[12 + j], 0x44);
    const __m512i groups23_high = _mm512_shuffle_i32x4(columns[8 + j], columns[12 + j], 0xee);
    rows[j] = _mm512_shuffle_i32x4(groups01_low, groups23_low, 0x88);
    rows[4 + j] = _mm512_shuffle_i32x4(groups01_low, groups23_low, 0xdd);
    rows[8 + j] = _mm512_shuffle_i32x4(groups01_high, groups23_high, 0x88);
    rows[12 + j] = _mm512_shuffle_i32x4(groups01_high, groups23_high, 0xdd);
  }
}

inline __mmask32 first_halves(int64_t count) { return count >= 32 ? ~__mmask32(0) : (__mmask32(1) << count) - 1; }
#endif

// Packs the B operand [K, N], B[k][n] = source[k * row + n * column], for the block products into `out`: panels of
// `panel_columns` columns (a multiple of 16 unless one panel holds all N), each `even(K)` rows (zero past K) by `panel_width` columns (zero past N), panel
// j at `out + j * even(K)`, in the rows-in-pairs layout oneDNN's brgemm reads with AMX tiles and with AVX512-BF16's
// pair products alike, B[k][c] at panel[(k / 2) 2 padded + 2 c + k % 2]. Written straight from the source rows (no
// unpacked copy), asking for the rows `kPrefetchRows` ahead: one head's rows lie far apart, and waiting for each made
// packing about 5% of a bfloat16 forward at 2,048 tokens.
template <typename T>
void pack(const T* source, int64_t row, int64_t column, int64_t K, int64_t N, int64_t panel_columns, T* out) {
  const int64_t Ke = even(K);
  for (int64_t j = 0; j < N; j += panel_columns) {
    const int64_t width = std::min(panel_columns, N - j), padded = panel_width(N, j, panel_columns);
    const T* columns = source + j * column;
    T* panel = out + j * Ke;
    if (row == 1) {  // a pair of rows is two neighbours in the source (keys transposed): one 32-bit copy per pair
      // 16 columns at a time, pair-row by pair-row: each pair-row's 16 copies fill one cache line of the panel, and the
      // group's 16 source rows stay in L1. Column by column, every copy went to another line of a panel larger than
      // L1 (a 512-key panel is 64 KB): a quarter of the kernel's own time at 512 tokens went to packing.
      for (int64_t c0 = 0; c0 < width; c0 += 16) {
        const int64_t stop = std::min(c0 + 16, width);
        for (int64_t c = c0; c < stop; ++c)
          if (j + c + kPrefetchRows < N) prefetch(columns + (c + kPrefetchRows) * column, K * sizeof(T));
        int64_t k = 0;
#if NEZHA_AVX512_PACKING
        if (sizeof(T) == 2 && stop - c0 == 16)  // 16 pairs of each of the 16 rows at a time, transposed in registers
          for (; k + 32 <= K; k += 32) {
            __m512i words[16];
            for (int c = 0; c < 16; ++c) words[c] = _mm512_loadu_si512(columns + (c0 + c) * column + k);
            transpose_16x16_words(words);
            for (int w = 0; w < 16; ++w) _mm512_storeu_si512(panel + (k + 2 * w) * padded + 2 * c0, words[w]);
          }
#endif
        for (; k + 1 < K; k += 2)
          for (int64_t c = c0; c < stop; ++c)
            std::memcpy(panel + k * padded + 2 * c, columns + c * column + k, 2 * sizeof(T));
      }
    } else {
#if NEZHA_AVX512_PACKING
      // Lane 2 i of `low_lanes` picks first[c + i], lane 2 i + 1 second[c + i]; `high_lanes` the same for c + 16 + i.
      const __m512i low_lanes = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                                 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i high_lanes = _mm512_add_epi16(low_lanes, _mm512_set1_epi16(16));
#endif
      for (int64_t k = 0; k + 1 < K; k += 2) {
        const T* first = columns + k * row;
        const T* second = first + row;
        if (k + kPrefetchRows + 1 < K) {
          prefetch(first + kPrefetchRows * row, width * sizeof(T));
          prefetch(second + kPrefetchRows * row, width * sizeof(T));
        }
        T* pairs = panel + k * padded;
        int64_t c = 0;
#if NEZHA_AVX512_PACKING
        if (sizeof(T) == 2 && column == 1)  // 32 columns of both rows at a time, interleaved in registers
          for (; c < width; c += 32) {
            const int64_t count = std::min<int64_t>(32, width - c);
            const __m512i a = _mm512_maskz_loadu_epi16(first_halves(count), first + c);
            const __m512i b = _mm512_maskz_loadu_epi16(first_halves(count), second + c);
            _mm512_mask_storeu_epi16(pairs + 2 * c, first_halves(2 * count), _mm512_permutex2var_epi16(a, low_lanes, b));
            if (count > 16)
              _mm512_mask_storeu_epi16(pairs + 2 * c + 32, first_halves(2 * (count - 16)),
                                       _mm512_permutex2var_epi16(a, high_lanes, b));
          }
#endif
        for (; c < width; ++c) {
          pairs[2 * c] = first[c * column];
          pairs[2 * c + 1] = second[c * column];
        }
      }
    }
    if (K % 2)  // the last row's pair partner is 0
      for (int64_t c = 0; c < width; ++c) {
        panel[(K - 1) * padded + 2 * c] = columns[(K - 1) * row + c * column];
        panel[(K - 1) * padded + 2 * c + 1] = T(0);
      }
    for (int64_t k = 0; k < Ke; k += 2)  // columns past N
      std::fill(panel + k * padded + 2 * width, panel + (k + 2) * padded, T(0));
  }
}

// A B operand [K, N] packed by `pack` in panels of `panel` columns.
template <typename T>
struct Packed {
  const T* data;
  int64_t K, N, panel;

  // C[M, 0 : count'] (+)= A[M, K] @ B[:, first : first + count], `first` a multiple of `panel`; whole panels are
  // written, so C needs `round_up(count, panel)` columns. A's column K must be 0 when K is odd. One brgemm call per
  // panel: a panel as wide as the key block is one call per block, as PyTorch's kernel makes (at 8,192 tokens on AMX,
  // 64-column panels, eight calls a block, took twice the time of one).
  void multiply(int64_t M, const T* A, int64_t lda, int64_t first, int64_t count, float* C, int64_t ldc,
                bool accumulate) const {
    if (M <= 0) return;
    const int64_t Ke = even(K);
    for (int64_t j = first; j < first + count; j += panel) {
      const int64_t width = panel_width(N, j, panel);
      cpublas::brgemm(M, width, Ke, lda, width, ldc, accumulate, A, data + j * Ke, C + (j - first), true);
    }
  }
};

// One head's rows [L, d] (row stride `ld`) packed two ways, both by blocks of `block` rows (`block` even, and a multiple
// of 16 where L > block). As panels of rows: the B operand of `x @ rows^T` (scores against keys, gradients against
// values), `Packed{d, L}` in panels of `block` columns, `panels_size(L, d)` elements. As blocks of rows: for each
// block starting at n, the B operand of `weights @ rows[n : n + block]`, `Packed{rows in it, d}` at
// `n * round_up(d, kPanel)`, in `blocks_size(L, d)` elements.
inline int64_t panels_size(int64_t L, int64_t d) { return d * round_up(L, kPanel); }
inline int64_t blocks_size(int64_t L, int64_t d) { return (L + 1) * round_up(d, kPanel); }

template <typename T>
Packed<T> row_panels(const T* storage, int64_t L, int64_t d, int64_t block) {
  return {storage, d, L, block};
}

template <typename T>
Packed<T> row_block(const T* storage, int64_t L, int64_t d, int64_t block, int64_t n) {
  return {storage + n * round_up(d, kPanel), std::min(block, L - n), d, kPanel};
}

template <typename T>
void pack_rows(const T* rows, int64_t ld, int64_t L, int64_t d, int64_t block, T* panels, T* blocks) {
  if (panels) pack(rows, 1, ld, d, L, block, panels);  // B[dim][row] = rows[row][dim]
  if (blocks)
    for (int64_t n = 0; n < L; n += block)
      pack(rows + n * ld, ld, 1, std::min(block, L - n), d, kPanel, blocks + n * round_up(d, kPanel));
}

// A [rows, count] matrix (row stride `ld_in`) transposed into [count, rows] (row stride `ld_out`), in tiles.
template <typename T>
void transpose(const T* in, int64_t ld_in, int64_t rows, int64_t count, T* out, int64_t ld_out) {
  constexpr int64_t tile = 32;
  for (int64_t r0 = 0; r0 < rows; r0 += tile)
    for (int64_t c0 = 0; c0 < count; c0 += tile)
      for (int64_t c = c0; c < std::min(c0 + tile, count); ++c)
        for (int64_t r = r0; r < std::min(r0 + tile, rows); ++r) out[c * ld_out + r] = in[r * ld_in + c];
}

// x rounded to bfloat16's bits, to nearest even (NaN kept), in integer arithmetic the compiler vectorises (c10's own
// conversion branches on NaN per element).
inline uint16_t bfloat16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7fffU + ((u >> 16) & 1U)) >> 16;
  return static_cast<uint16_t>(x != x ? 0x7fc0U : rounded);
}

// out[c] = x as the type T (float32 as it is, bfloat16 by `bfloat16_bits`, float16 by c10).
template <typename T>
inline void put(T* out, int64_t c, float x) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    reinterpret_cast<uint16_t*>(out)[c] = bfloat16_bits(x);
  } else {
    out[c] = static_cast<T>(x);
  }
}

// `count` floats as the type T, by the CPU's conversion instruction where the compiler targets one (AVX512-BF16's
// vcvtneps2bf16 rounds to nearest even and keeps NaN, as `put` does, but reads float32 subnormals as 0).
template <typename T>
inline void convert(const float* in, T* out, int64_t count);

// --- the arithmetic of one row ----------------------------------------------------------------------------------

// exp(r) on [-ln 2 / 2, ln 2 / 2]: a degree-5 polynomial fitted for relative error (1.7e-7 evaluated in float32), its
// constant term 1 so that exp(0) is 1 exactly (a row with one visible key gives that key's value exactly).
constexpr float kExpPolynomial[6] = {1.0f, 0.9999997020f, 0.4999915063f, 0.1666763574f, 0.0418979302f, 0.0082903150f};

// expf to about 2 ulp for x <= 0 (a score minus its row's maximum or log-sum-exp), written so the compiler vectorises
// the loops that call it: 0 below -87 (and for -inf), NaN stays NaN. exp(x) = 2^n exp(r), x = n ln 2 + r.
inline float fast_exp(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = kExpPolynomial[5];
  for (int k = 4; k >= 0; --k) p = p * r + kExpPolynomial[k];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float power;
  std::memcpy(&power, &bits, sizeof(float));
  return x < -87.0f ? 0.0f : p * power;
}

// --- the passes over one column range of a row ------------------------------------------------------------------
// Each works on `count` columns. `terms` are the range's relative terms: one per column in the band (`Band`), one for
// the whole range in a tail. With AVX-512 (what the compiler targets) they run 16 columns at a time; elsewhere they
// are plain loops the compiler vectorises. Both compute the same numbers, `fast_exp`'s included.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NEZHA_AVX512 1

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xffff) : __mmask16((1U << count) - 1);
}

// body(c, mask, chain) for the columns [c, c + 16) of [0, count): whole steps with a constant full mask (the compiler
// drops it: masked 16-bit stores are slow), two at a time alternating `chain` (0, 1), so that sums and maxima run as two
// independent dependency chains; then one masked step for what is left.
template <typename Body>
inline void in_steps_of_16(int64_t count, Body&& body) {
  constexpr __mmask16 all = 0xffff;
  int64_t c = 0;
  for (; c + 32 <= count; c += 32) {
    body(c, all, 0);
    body(c + 16, all, 1);
  }
  for (; c + 16 <= count; c += 16) body(c, all, 0);
  if (c < count) body(c, first_lanes(count - c), 0);
}

// `fast_exp` of 16 lanes (vscalefps puts the power of two in).
inline __m512 fast_exp16(__m512 x) {
  const __mmask16 small = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // NaN stays NaN (vmaxps returns its second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc));
  __m512 p = _mm512_set1_ps(kExpPolynomial[5]);
  for (int k = 4; k >= 0; --k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPolynomial[k]));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~small), p, n);
}

// Stores the first lanes of x (by `mask`) as T.
template <typename T>
inline void store16(T* out, __mmask16 mask, __m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(out, mask, x);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(__AVX512BF16__)
    const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
    const __m512i u = _mm512_castps_si512(x);
    __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), _mm512_set1_epi32(0x7fc00000), rounded);
    const __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
    _mm256_mask_storeu_epi16(out, mask, bits);
  } else {
    _mm256_mask_storeu_epi16(out, mask, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}
#endif

// The range's maximum score, the scores being row[c] * scale + term. The band's scores are written into the row (their
// terms differ per column); a tail's are left as they are and its maximum derived from theirs (`exponentials` applies
// the affine map): one read of the row instead of a read and a write. -inf when empty; NaN scores do not count.
template <bool Band>
inline float scale_add_max(float* row, const float* terms, float scale, int64_t count) {
  if (count <= 0) return kNegInf;
#if NEZHA_AVX512
  const __m512 factor = _mm512_set1_ps(scale);
  __m512 largest[2] = {_mm512_set1_ps(kNegInf), _mm512_set1_ps(kNegInf)};
  in_steps_of_16(count, [&](int64_t c, __mmask16 mask, int chain) {
    __m512 x = _mm512_maskz_loadu_ps(mask, row + c);
    if constexpr (Band) {
      x = _mm512_fmadd_ps(x, factor, _mm512_maskz_loadu_ps(mask, terms + c));
      _mm512_mask_storeu_ps(row + c, mask, x);
    }
    // vmaxps returns its second operand where x is NaN
    largest[chain] = _mm512_mask_max_ps(largest[chain], mask, x, largest[chain]);
  });
  const float range_max = _mm512_reduce_max_ps(_mm512_max_ps(largest[0], largest[1]));
#else
  float range_max = kNegInf;
#pragma omp simd reduction(max : range_max)
  for (int64_t c = 0; c < count; ++c) {
    if constexpr (Band) row[c] = row[c] * scale + terms[c];
    range_max = row[c] > range_max ? row[c] : range_max;
  }
#endif
  return Band ? range_max : range_max * scale + terms[0];
}

// e = fast_exp(row[c] * scale + shift) into out[c] as T (in place for float32); in the band also bucket[c] += e.
// Returns the sum of e.
template <bool Band, typename T>
inline float exponentials(const float* row, float scale, float shift, T* out, float* bucket, int64_t count) {
#if NEZHA_AVX512
  const __m512 factor = _mm512_set1_ps(scale), offset = _mm512_set1_ps(shift);
  __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  in_steps_of_16(count, [&](int64_t c, __mmask16 mask, int chain) {
    const __m512 e = fast_exp16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, row + c), factor, offset));
    sum[chain] = _mm512_mask_add_ps(sum[chain], mask, sum[chain], e);
    if constexpr (Band) _mm512_mask_storeu_ps(bucket + c, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, bucket + c), e));
    store16(out + c, mask, e);
  });
  return _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
#else
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < count; ++c) {
    const float e = fast_exp(row[c] * scale + shift);
    sum += e;
    if constexpr (Band) bucket[c] += e;
    put(out, c, e);
  }
  return sum;
#endif
}

// The backward's pass without dropout: p = fast_exp(prob[c] * scale + term - lse), dS = p (grad[c] + value_term -
// dot), written into prob and grad; in the band also bucket[c] += dS. Returns the sum of dS.
template <bool Band>
inline float score_gradients(float* prob, float* grad, const float* terms, const float* value_terms, float scale,
                             float lse, float dot, float* bucket, int64_t count) {
  if (count <= 0) return 0.0f;
#if NEZHA_AVX512
  const __m512 factor = _mm512_set1_ps(scale), shift = _mm512_set1_ps(lse), row_dot = _mm512_set1_ps(dot);
  const __m512 term = _mm512_set1_ps(terms[0]), value_term = _mm512_set1_ps(value_terms[0]);
  __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  in_steps_of_16(count, [&](int64_t c, __mmask16 mask, int chain) {
    const __m512 t = Band ? _mm512_maskz_loadu_ps(mask, terms + c) : term;
    const __m512 vt = Band ? _mm512_maskz_loadu_ps(mask, value_terms + c) : value_term;
    const __m512 p = fast_exp16(_mm512_sub_ps(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, prob + c), factor, t), shift));
    const __m512 g = _mm512_mul_ps(p, _mm512_sub_ps(_mm512_add_ps(_mm512_maskz_loadu_ps(mask, grad + c), vt), row_dot));
    _mm512_mask_storeu_ps(prob + c, mask, p);
    _mm512_mask_storeu_ps(grad + c, mask, g);
    sum[chain] = _mm512_mask_add_ps(sum[chain], mask, sum[chain], g);
    if constexpr (Band) _mm512_mask_storeu_ps(bucket + c, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, bucket + c), g));
  });
  return _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
#else
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < count; ++c) {
    prob[c] = fast_exp(prob[c] * scale + terms[Band ? c : 0] - lse);
    grad[c] = prob[c] * (grad[c] + value_terms[Band ? c : 0] - dot);
    sum += grad[c];
    if constexpr (Band) bucket[c] += grad[c];
  }
  return sum;
#endif
}

// `count` floats as the type T.
template <typename T>
inline void convert(const float* in, T* out, int64_t count) {
#if NEZHA_AVX512
  in_steps_of_16(count, [&](int64_t c, __mmask16 mask, int) { store16(out + c, mask, _mm512_maskz_loadu_ps(mask, in + c)); });
#else
#pragma omp simd
  for (int64_t c = 0; c < count; ++c) put(out, c, in[c]);
#endif
}

// A 32-bit integer hash with full avalanche ("lowbias32", C. Wellons' hash prospector).
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// bucket[first + c] += values[c] over a band range; a tail range (step 0) adds its total to one bucket.
template <typename Step>
inline void add_to_bucket(float* bucket, const float* values, int64_t start, int64_t stop, int64_t first, Step step,
                          float range_total) {
  if (step) {
#pragma omp simd
    for (int64_t c = start; c < stop; ++c) bucket[first + c] += values[c];
  } else {
    bucket[first] += range_total;
  }
}

// Ctrl-C or SIGTERM while the kernel runs. Python runs a signal's handler only between bytecodes, and the calling thread
// is inside the kernel, so the kernel runs pending handlers itself (`PyErr_CheckSignals`, with the GIL) between its
// tasks on that thread. Once a handler has raised, every thread skips its remaining tasks and the entry point
// re-raises the handler's exception: a call of any length ends within a task's time of the signal.
struct Interruption {
  std::atomic<bool> raised{false};

  // Whether to stop; on the calling thread (thread 0 of the parallel region), pending signal handlers run first.
  bool check() {
    if (!raised.load(std::memory_order_relaxed) && at::get_thread_num() == 0) {
      pybind11::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() != 0) raised.store(true);
    }
    return raised.load(std::memory_order_relaxed);
  }
};

struct Problem {
  int64_t B, H, Lq, Lk, d, K, R, offset;
  Interruption* interruption;
  float scale;
  bool causal;
  const bool* key_valid;         // [B, Lk] or null
  const bool* key_source;        // [B, Lk] or null (UniLM prefix mask, with causal)
  std::vector<int64_t> key_end;      // per batch row: keys past this are never visible to a causal query block
  std::vector<int64_t> first_valid;  // per batch row: its first key that is not padding (Lk if none)
  std::vector<bool> valid_source;    // per batch row: whether a source key is not padding (a prefix mask)
  int64_t q_block, kv_block;
  bool dropout;
  uint32_t threshold, seed_lo, seed_hi;  // keep_ij when its hash >= threshold = p * 2^32
  float keep_scale;                      // 1 / (1 - p)

  // Keys a causal query block ending before absolute position `stop` may see: up to itself, or to the last source key.
  int64_t keys_for(int64_t b, int64_t stop) const { return causal ? std::min(Lk, std::max(stop, key_end[b])) : Lk; }

  // Whether query position `i` of batch row `b` sees no key at all (all padding, or left padding under a causal
  // mask): its output is 0, as transformers 5's BERT gives by default. Any other row that ends up with no
  // probability mass had only -inf scores (infinite inputs) and gives NaN, as eager attention does.
  bool sees_nothing(int64_t b, int64_t i) const {
    return causal ? first_valid[b] > i && !valid_source[b] : first_valid[b] == Lk;
  }

  // Calls body(start, stop, first, step) for the three column ranges of query position `i` in the key
  // block starting at `n` with `kb` keys: the left tail, the band and the right tail. Column `c` of a
  // range uses table row `first + step * c`; step is a compile-time 0 in the tails and 1 in the band.
  template <typename Body>
  void for_each_range(int64_t i, int64_t n, int64_t kb, Body&& body) const {
    const int64_t left = std::min(std::max(i - K + 1 - n, int64_t(0)), kb);
    const int64_t right = std::min(std::max(i + K - n, int64_t(0)), kb);
    body(int64_t(0), left, int64_t(0), std::integral_constant<int64_t, 0>());
    body(left, right, n - i + K, std::integral_constant<int64_t, 1>());
    body(right, kb, 2 * K, std::integral_constant<int64_t, 0>());
  }

  void apply_mask(float* row, int64_t b, int64_t i, int64_t n, int64_t kb) const {
    if (!causal && !key_valid) return;
    const bool* valid = key_valid ? key_valid + b * Lk + n : nullptr;
    const bool* source = key_source ? key_source + b * Lk + n : nullptr;
    for (int64_t c = 0; c < kb; ++c) {
      bool visible = !valid || valid[c];
      if (causal) visible = visible && (n + c <= i || (source && source[c]));
      if (!visible) row[c] = kNegInf;
    }
  }

  // The dropout stream of one query row: key ("bh" = batch * heads + head, "i" = query position).
  uint32_t row_key(int64_t bh, int64_t i) const {
    return mix32(mix32(mix32(seed_lo ^ mix32(seed_hi)) ^ static_cast<uint32_t>(bh)) ^ static_cast<uint32_t>(i));
  }

  // keep_ij / (1 - p) for key position j of the row with dropout stream `key`: 1 / (1 - p) or 0.
  inline float keep_factor(uint32_t key, int64_t j) const {
    return mix32(key ^ (static_cast<uint32_t>(j) * 0x9e3779b9U)) >= threshold ? keep_scale : 0.0f;
  }
};

// One call's `attention_ops.AttentionProblem`, as the entry points read it by name (with the GIL held).
struct Asked {
  double scale = 1.0, dropout = 0.0;
  bool causal = false;
  at::Tensor key_valid, key_source;  // bool [B, Lk], contiguous, or undefined
  int64_t offset = 0, seed = 0;
};

int64_t as_int(const pybind11::handle& value) {  // an int, or a 0-dim tensor
  return pybind11::isinstance<pybind11::int_>(value) ? value.cast<int64_t>() : value.cast<at::Tensor>().item<int64_t>();
}

at::Tensor as_flags(const pybind11::handle& value) {
  return value.is_none() ? at::Tensor() : value.cast<at::Tensor>().to(at::kBool).contiguous();
}

Asked read_problem(const pybind11::handle& problem) {
  const pybind11::object mask = problem.attr("mask"), seed = problem.attr("seed");
  Asked asked;
  asked.scale = problem.attr("scaling").cast<double>();
  asked.dropout = problem.attr("dropout").cast<double>();
  asked.seed = seed.is_none() ? 0 : as_int(seed);
  asked.causal = mask.attr("causal").cast<bool>();
  asked.key_valid = as_flags(mask.attr("key_is_valid"));
  asked.key_source = as_flags(mask.attr("key_is_source"));  // None unless causal (RelativeAttentionMask)
  asked.offset = as_int(mask.attr("query_offset"));
  return asked;
}

Problem make_problem(const at::Tensor& q, const at::Tensor& k, int64_t K, const Asked& asked, int64_t q_block,
                     int64_t kv_block, Routine routine, Interruption& interruption) {
  Problem p;
  p.interruption = &interruption;
  p.B = q.size(0), p.H = q.size(1), p.Lq = q.size(2), p.Lk = k.size(2), p.d = q.size(3);
  p.K = K, p.R = 2 * K + 1, p.offset = asked.offset;
  p.scale = static_cast<float>(asked.scale);
  p.causal = asked.causal;
  p.key_valid = asked.key_valid.defined() ? asked.key_valid.data_ptr<bool>() : nullptr;
  p.key_source = asked.key_source.defined() ? asked.key_source.data_ptr<bool>() : nullptr;
  p.key_end.assign(p.B, 0);
  p.first_valid.assign(p.B, p.key_valid ? p.Lk : 0);
  p.valid_source.assign(p.B, false);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t j = p.Lk - 1; j >= 0; --j) {
      const bool valid = !p.key_valid || p.key_valid[b * p.Lk + j];
      if (valid) p.first_valid[b] = j;
      if (p.causal && p.key_source && p.key_source[b * p.Lk + j]) {
        p.key_end[b] = std::max(p.key_end[b], j + 1);
        if (valid) p.valid_source[b] = true;
      }
    }
  // 0: PyTorch's own CPU flash kernel's choice (query blocks by length, 512 keys); tests pass small blocks. Packed
  // keys come in whole panels, so a key block is a whole number of them.
  p.q_block = q_block > 0 ? q_block : p.Lq >= 768 ? 256 : p.Lq >= 192 ? 64 : 32;
  p.kv_block = kv_block > 0 ? kv_block : 512;
  if (routine == kReducedPacked) p.kv_block = round_up(p.kv_block, kPanel);
  p.dropout = asked.dropout > 0.0;
  p.threshold = static_cast<uint32_t>(std::min(std::ldexp(asked.dropout, 32), 4294967295.0));
  p.keep_scale = p.dropout ? static_cast<float>(1.0 / (1.0 - asked.dropout)) : 1.0f;
  p.seed_lo = static_cast<uint32_t>(static_cast<uint64_t>(asked.seed) & 0xffffffffU);
  p.seed_hi = static_cast<uint32_t>(static_cast<uint64_t>(asked.seed) >> 32);
  return p;
}

// Rows of a [B, H, L, d] tensor must be distinct, unit-stride vectors for the BLAS calls (an expanded
// length dimension, stride 0, would alias them): anything else is copied first.
at::Tensor rows_usable(const at::Tensor& t) {
  return t.stride(3) == 1 && t.stride(2) >= t.size(3) ? t : t.contiguous();
}

void check_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& table,
                  const Asked& asked) {
  const auto type = query.scalar_type();
  for (const at::Tensor* t : {&query, &key, &value})
    TORCH_CHECK(t->scalar_type() == type && (type == at::kFloat || is_reduced(type)) && t->device().is_cpu() &&
                    t->dim() == 4,
                "NEZHA kernel: expected CPU tensors [batch, heads, length, head_size] of one type: float32, bfloat16 "
                "or float16");
  TORCH_CHECK(key.sizes() == value.sizes(), "NEZHA kernel: key and value must have the same shape");
  TORCH_CHECK(query.size(3) % 2 == 0, "NEZHA kernel: the head size must be even (the table pairs sines and cosines)");
  TORCH_CHECK(key.size(0) == query.size(0) && key.size(1) == query.size(1) && key.size(3) == query.size(3),
              "NEZHA kernel: query, key and value must agree in batch, heads and head size");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 2 && table.size(0) % 2 == 1 &&
                  table.size(1) == query.size(3),
              "NEZHA kernel: the table must be float32 [2K + 1, head_size]");
  for (const at::Tensor* flags : {&asked.key_valid, &asked.key_source})
    TORCH_CHECK(!flags->defined() || (flags->dim() == 2 && flags->size(0) == query.size(0) && flags->size(1) == key.size(2)),
                "NEZHA kernel: key flags must be [batch, key_length]");
  TORCH_CHECK(asked.dropout >= 0.0 && asked.dropout < 1.0, "NEZHA kernel: dropout must be in [0, 1)");
}

// --- forward ----------------------------------------------------------------------------------------------------

// The relative table prepared for its products: with queries (or output gradients), x T^T, and with the bucket masses,
// bucket T. float32 multiplies float32 rows with the table as it is; reduced precision multiplies the rows as they
// are with the table packed (the model's table reaches the kernel already rounded to the input type, so it is
// exact), and rounds the bucket masses as it rounds the probabilities.
template <typename T>
struct TableOperands {
  static constexpr bool reduced = !std::is_same_v<T, float>;
  int64_t R, d, ld;  // ld: the row stride of `terms`' results (whole packed panels)
  at::Tensor table, table_t;
  Buffer<T> panels, block;

  explicit TableOperands(const at::Tensor& table_float)
      : R(table_float.size(0)), d(table_float.size(1)), ld(reduced ? round_up(R, kPanel) : R), table(table_float) {
    if constexpr (reduced) {
      const at::Tensor rounded = table_float.to(type_of<T>()).contiguous();
      panels.resize(panels_size(R, d));
      block.resize(blocks_size(R, d));
      pack_rows(rounded.data_ptr<T>(), d, R, d, even(R), panels.data(), block.data());
    } else {
      table_t = table_float.t().contiguous();
    }
  }

  // out[qb, R] = rows[qb, d] T^T (row stride `ld`).
  void terms(int64_t qb, const T* rows, int64_t ld_rows, float* out) const {
    if constexpr (reduced) {
      row_panels(panels.data(), R, d, even(R)).multiply(qb, rows, ld_rows, 0, R, out, ld, false);
    } else {
      gemm(qb, R, d, rows, ld_rows, table_t.data_ptr<float>(), R, out, ld, false);
    }
  }

  // acc[qb, :d] += bucket[qb, R] T; reduced precision rounds the masses into `rounded` (`even(R)` wide, its padding
  // column zero as allocated: only the first R columns are written) first.
  void add_value_term(int64_t qb, const float* bucket, T* rounded, float* acc, int64_t ld_acc) const {
    if constexpr (reduced) {
      const int64_t width = even(R);
      for (int64_t r = 0; r < qb; ++r) convert(bucket + r * R, rounded + r * width, R);
      row_block(block.data(), R, d, even(R), 0).multiply(qb, rounded, width, 0, d, acc, ld_acc, true);
    } else {
      gemm(qb, d, R, bucket, R, table.data_ptr<float>(), d, acc, ld_acc, true);
    }
  }
};

// Calls with at most this many queries (decoding from a cache) multiply the keys and values where they lie.
constexpr int64_t kDirectQueries = 16;
// The keys and values prepared for the forward's products: float32, K^T [B, H, d, Lk] once per call and the values
// as they are; reduced precision, one head's keys packed as panels and values as blocks (`pack_rows`) into a
// thread's own `HeadPacks`, by that thread, just before its first query block of the head (`pack_head`). Packing
// every head first, in a pass of its own, cost a second parallel region and left the packed heads to be read back
// from memory (2 MB a head at 8,192 tokens); query blocks vary fastest in the tasks, so a thread packs each of its
// heads once (and a head split between two threads twice). A call with few queries (`kDirectQueries`, decoding)
// prepares nothing: it reads the keys and values row by row where they lie, because preparing them costs a pass over
// the whole cache (a transposed copy, or packing) for a handful of products.
template <typename T>
struct ForwardOperands {
  // The rows of a [B, H, L, d] tensor as they lie (unit stride: `rows_usable`), read once from the tensor: a decoding
  // step takes a row per key, and `Tensor::data_ptr` checks the type on every call.
  struct Rows {
    const T* data;
    int64_t H, batch_stride, head_stride, row_stride;
    explicit Rows(const at::Tensor& t)
        : data(t.data_ptr<T>()), H(t.size(1)), batch_stride(t.stride(0)), head_stride(t.stride(1)),
          row_stride(t.stride(2)) {}
    // Row n of head `bh`.
    const T* operator()(int64_t bh, int64_t n) const {
      return data + bh / H * batch_stride + bh % H * head_stride + n * row_stride;
    }
  };

  // Reduced precision: one head's keys and values packed, a thread's own (empty for float32 and decoding).
  struct HeadPacks {
    Buffer<T> keys, values;
    int64_t bh = -1;  // the head they hold
  };

  const Problem& p;
  const Rows key_rows, value_rows;
  const bool direct;
  at::Tensor keys;  // float32: K^T

  ForwardOperands(const Problem& p, const at::Tensor& key, const at::Tensor& value)
      : p(p), key_rows(key), value_rows(value), direct(p.Lq <= kDirectQueries) {
    if constexpr (std::is_same_v<T, float>)
      if (!direct) keys = key.transpose(2, 3).contiguous();
  }

  HeadPacks head_packs() const {
    HeadPacks packs;
    if (!std::is_same_v<T, float> && !direct) {
      packs.keys.resize(panels_size(p.Lk, p.d));
      packs.values.resize(blocks_size(p.Lk, p.d));
    }
    return packs;
  }

  // Packs head `bh` into `packs` unless they hold it (or nothing is packed here).
  void pack_head(int64_t bh, HeadPacks& packs) const {
    if (packs.keys.empty() || packs.bh == bh) return;
    pack_rows(key_rows(bh, 0), key_rows.row_stride, p.Lk, p.d, p.kv_block, packs.keys.data(), static_cast<T*>(nullptr));
    pack_rows(value_rows(bh, 0), value_rows.row_stride, p.Lk, p.d, p.kv_block, static_cast<T*>(nullptr),
              packs.values.data());
    packs.bh = bh;
  }

  // scores[qb, :] = Q[qb, d] K[n : n + kb]^T of head `bh` (reduced precision: the head `packs` hold).
  void scores(int64_t bh, const HeadPacks& packs, int64_t qb, const T* queries, int64_t ld_queries, int64_t n,
              int64_t kb, float* out, int64_t ld_out) const {
    if (direct) {
      for (int64_t r = 0; r < qb; ++r) {
        const T* q = queries + r * ld_queries;
        for (int64_t c = 0; c < kb; ++c) {
          const T* k = key_rows(bh, n + c);
          if (r == 0 && n + c + kPrefetchRows < p.Lk) prefetch(key_rows(bh, n + c + kPrefetchRows), p.d * sizeof(T));
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t x = 0; x < p.d; ++x) dot += static_cast<float>(q[x]) * static_cast<float>(k[x]);
          out[r * ld_out + c] = dot;
        }
      }
    } else if constexpr (std::is_same_v<T, float>) {
      gemm(qb, kb, p.d, queries, ld_queries, keys.data_ptr<float>() + bh * p.d * p.Lk + n, p.Lk, out, ld_out, false);
    } else {
      row_panels(packs.keys.data(), p.Lk, p.d, p.kv_block).multiply(qb, queries, ld_queries, n, kb, out, ld_out, false);
    }
  }

  // acc[qb, :d] += probs[qb, kb] V[n : n + kb] of head `bh` (reduced precision: the head `packs` hold).
  void weighted_values(int64_t bh, const HeadPacks& packs, int64_t qb, const T* probs, int64_t ld_probs, int64_t n,
                       int64_t kb, float* acc, int64_t ld_acc) const {
    if (direct) {
      for (int64_t r = 0; r < qb; ++r) {
        float* a = acc + r * ld_acc;
        for (int64_t c = 0; c < kb; ++c) {
          const float weight = static_cast<float>(probs[r * ld_probs + c]);
          const T* v = value_rows(bh, n + c);
          if (r == 0 && n + c + kPrefetchRows < p.Lk) prefetch(value_rows(bh, n + c + kPrefetchRows), p.d * sizeof(T));
#pragma omp simd
          for (int64_t x = 0; x < p.d; ++x) a[x] += weight * static_cast<float>(v[x]);
        }
      }
    } else if constexpr (std::is_same_v<T, float>) {
      gemm(qb, p.d, kb, probs, ld_probs, value_rows(bh, n), value_rows.row_stride, acc, ld_acc, true);
    } else {
      row_block(packs.values.data(), p.Lk, p.d, p.kv_block, n).multiply(qb, probs, ld_probs, 0, p.d, acc, ld_acc, true);
    }
  }
};

// Returns (out [B, Lq, H, d] contiguous, lse [B, H, Lq]); a row that sees no key gets out 0, lse -inf.
template <typename T>
void forward_impl(const Problem& p, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& T_table, at::Tensor& out, at::Tensor& lse) {
  constexpr bool reduced = !std::is_same_v<T, float>;
  const int64_t B = p.B, H = p.H, Lq = p.Lq, d = p.d, R = p.R, Lk = p.Lk;
  const ForwardOperands<T> operands(p, key, value);
  const TableOperands<T> table(T_table);
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  float* l = lse.data_ptr<float>();
  const int64_t qs = query.stride(2);
  const int64_t num_q_blocks = (Lq + p.q_block - 1) / p.q_block;
  // Row strides of the scores (and, reduced, of the probabilities and the accumulator): whole packed panels.
  const int64_t ld_scores = reduced ? round_up(p.kv_block, kPanel) : p.kv_block;
  const int64_t ld_probs = even(p.kv_block), ld_acc = reduced ? round_up(d, kPanel) : d;

  // One task per (batch, head, query block); query blocks vary fastest so each thread gets whole heads.
  at::parallel_for(0, B * H * num_q_blocks, 1, [&](int64_t begin, int64_t end) {
    Buffer<float> scores(p.q_block * ld_scores), qt(p.q_block * table.ld), bucket(p.q_block * R);
    Buffer<float> acc(p.q_block * ld_acc), row_max(p.q_block), row_sum(p.q_block);
    Buffer<T> probs(reduced ? p.q_block * ld_probs : 0);
    Buffer<T> rounded_bucket(reduced ? p.q_block * even(R) : 0);
    std::vector<uint32_t> row_keys(p.q_block);
    auto packs = operands.head_packs();
    for (int64_t task = begin; task < end; ++task) {
      if (p.interruption->check()) break;
      const int64_t b = task / (H * num_q_blocks), h = task / num_q_blocks % H, bh = b * H + h;
      operands.pack_head(bh, packs);
      const int64_t m = task % num_q_blocks * p.q_block, qb = std::min(p.q_block, Lq - m);
      const T* qm = q + b * query.stride(0) + h * query.stride(1) + m * qs;
      table.terms(qb, qm, qs, qt.data());  // q . T[p]
      for (int64_t x = 0; x < qb * table.ld; ++x) qt[x] *= p.scale;  // scaled like the scores
      std::fill(bucket.begin(), bucket.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.0f);
      if (p.dropout)
        for (int64_t r = 0; r < qb; ++r) row_keys[r] = p.row_key(bh, p.offset + m + r);
      const int64_t keys = p.keys_for(b, p.offset + m + qb);
      for (int64_t n = 0; n < keys; n += p.kv_block) {
        const int64_t kb = std::min(p.kv_block, keys - n);
        const int64_t ld = reduced ? ld_scores : kb;
        operands.scores(bh, packs, qb, qm, qs, n, kb, scores.data(), ld);
        // The probabilities the value product takes (reduced: their own buffer, as wide as the packed key block).
        const int64_t value_keys = reduced ? std::min(p.kv_block, Lk - n) : kb;
        for (int64_t r = 0; r < qb; ++r) {
          const int64_t i = p.offset + m + r;
          float* row = scores.data() + r * ld;
          T* kept = reduced ? probs.data() + r * ld_probs : nullptr;
          const float* terms = qt.data() + r * table.ld;
          p.apply_mask(row, b, i, n, kb);
          float new_max = row_max[r];
          p.for_each_range(i, n, kb, [&](int64_t start, int64_t stop, int64_t first, auto step) {
            // Scores with the relative key term; masked entries stay -inf.
            new_max = std::max(new_max, scale_add_max<step>(row + start, terms + first + step * start, p.scale, stop - start));
          });
          // A NaN score makes the row NaN, as in eager attention. The maximum skips it, but beside any finite score
          // its exponential is NaN and so is the row; only beside nothing but -inf must it be looked for.
          if (new_max == kNegInf && std::any_of(row, row + kb, [](float x) { return x != x; }))
            new_max = std::numeric_limits<float>::quiet_NaN();
          if (new_max == kNegInf) {  // nothing visible yet: this block adds nothing to the row
            if constexpr (reduced) {
              std::fill(kept, kept + even(value_keys), T(0));
            } else {
              std::fill(row, row + kb, 0.0f);
            }
            continue;
          }
          const float correction = fast_exp(row_max[r] - new_max);  // 0 while the row was empty
          float* row_bucket = bucket.data() + r * R;
          float* row_acc = acc.data() + r * ld_acc;
          if (correction != 1.0f) {
            for (int64_t x = 0; x < R; ++x) row_bucket[x] *= correction;
            for (int64_t x = 0; x < d; ++x) row_acc[x] *= correction;
          }
          // The probabilities the value product takes: float32 in place, reduced precision rounded into `kept`.
          T* stored = reduced ? kept : reinterpret_cast<T*>(row);
          float sum = 0.0f;  // the softmax denominator counts every probability, dropped or not
          p.for_each_range(i, n, kb, [&](int64_t start, int64_t stop, int64_t first, auto step) {
            float* bucket_range = row_bucket + first + step * start;
            // The band's scores are in the row; a tail's are q . k, to be scaled and given its term (`scale_add_max`).
            const float range_scale = step ? 1.0f : p.scale, shift = (step ? 0.0f : terms[first]) - new_max;
            if (!p.dropout) {
              const float range_sum =
                  exponentials<step>(row + start, range_scale, shift, stored + start, bucket_range, stop - start);
              sum += range_sum;
              if constexpr (!step) *bucket_range += range_sum;  // a tail's mass, to its one bucket
              return;
            }
            float range_sum = 0.0f, kept_sum = 0.0f;  // both value terms see p_ij keep_ij / (1 - p)
            const uint32_t key = row_keys[r];
#pragma omp simd reduction(+ : range_sum, kept_sum)
            for (int64_t c = start; c < stop; ++c) {
              const float e = fast_exp(row[c] * range_scale + shift);
              range_sum += e;
              row[c] = e * p.keep_factor(key, n + c);
              kept_sum += row[c];
            }
            sum += range_sum;
            add_to_bucket(row_bucket, row, start, stop, first, step, kept_sum);  // value term mass
          });
          if constexpr (reduced) {  // the value product's operand: zero past the keys this row sees
            if (p.dropout) convert(row, kept, kb);
            std::fill(kept + kb, kept + even(value_keys), T(0));
          }
          row_sum[r] = row_sum[r] * correction + sum;
          row_max[r] = new_max;
        }
        operands.weighted_values(bh, packs, qb, reduced ? probs.data() : reinterpret_cast<T*>(scores.data()),
                                 reduced ? ld_probs : kb, n, kb, acc.data(), ld_acc);
      }
      table.add_value_term(qb, bucket.data(), rounded_bucket.data(), acc.data(), ld_acc);
      for (int64_t r = 0; r < qb; ++r) {
        const bool empty = p.sees_nothing(b, p.offset + m + r);
        const float inverse = empty ? 0.0f : 1.0f / row_sum[r];  // a sum of 0 otherwise: NaN, as in eager
        float* row_acc = acc.data() + r * ld_acc;
        for (int64_t x = 0; x < d; ++x) row_acc[x] = empty ? 0.0f : row_acc[x] * inverse;
        // Rounded by `convert`, 16 at a time: c10's conversion, one element at a time with a NaN branch, was a fifth
        // of the kernel's own time in a bfloat16 forward at 512 tokens.
        convert(row_acc, o + ((b * Lq + m + r) * H + h) * d, d);
        l[(b * H + h) * Lq + m + r] = empty                ? kNegInf
                                      : row_sum[r] == 0.0f ? std::numeric_limits<float>::quiet_NaN()
                                                           : row_max[r] + std::log(row_sum[r]);
      }
    }
    if constexpr (reduced) cpublas::brgemm_release();  // this thread's tile state, for whoever uses the tiles next
  });
}

// --- backward ---------------------------------------------------------------------------------------------------

// Gradients of query [B, Lq, H, d], key and value [B, Lk, H, d] (float32, contiguous), given the forward's output and
// lse. float32 accumulates the key and value gradients transposed ([B, H, d, Lk], as its products give them); reduced
// precision as rows as wide as the packed panels ([B, H, Lk, round_up(d, 64)]).
template <typename T>
std::vector<at::Tensor> backward_impl(const Problem& p, const at::Tensor& grad_out, const at::Tensor& query,
                                      const at::Tensor& key, const at::Tensor& value, const at::Tensor& out,
                                      const at::Tensor& row_lse, const at::Tensor& T_table) {
  constexpr bool reduced = !std::is_same_v<T, float>;
  const int64_t B = p.B, H = p.H, Lq = p.Lq, Lk = p.Lk, d = p.d, R = p.R;
  const int64_t ld_grad = reduced ? round_up(d, kPanel) : d;  // of the reduced key / value gradients and of `acc`
  const auto float_options = query.options().dtype(at::kFloat);
  auto grad_query = at::empty({B, Lq, H, d}, float_options);
  auto grad_key = reduced ? at::zeros({B, H, Lk, ld_grad}, float_options) : at::zeros({B, H, d, Lk}, float_options);
  auto grad_value = at::zeros_like(grad_key);
  // float32's products take no transposes: K^T and V^T once per call.
  const at::Tensor key_t = reduced ? at::Tensor() : key.transpose(2, 3).contiguous();
  const at::Tensor value_t = reduced ? at::Tensor() : value.transpose(2, 3).contiguous();
  const TableOperands<T> table(T_table);
  const T *q = query.data_ptr<T>(), *k = key.data_ptr<T>(), *v = value.data_ptr<T>();
  const T *go = grad_out.data_ptr<T>(), *o = out.data_ptr<T>();
  const float* lse_data = row_lse.data_ptr<float>();
  float *gq = grad_query.data_ptr<float>(), *gk = grad_key.data_ptr<float>(), *gv = grad_value.data_ptr<float>();
  const int64_t qs = query.stride(2), ks = key.stride(2), vs = value.stride(2), gos = grad_out.stride(2);
  const int64_t os = out.stride(2), gs = H * d;  // the query gradient is [B, L, H, d]
  const int64_t ld_scores = reduced ? round_up(p.kv_block, kPanel) : p.kv_block;
  const int64_t ld_kept = even(p.kv_block), ld_kept_t = even(p.q_block);

  // One task per (batch, head): key and value gradients of a head are summed over its query blocks.
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    Buffer<float> probs(p.q_block * ld_scores), grad_scores(p.q_block * ld_scores);
    Buffer<float> qt(p.q_block * table.ld), grad_terms(p.q_block * table.ld), grad_bucket(p.q_block * R);
    Buffer<float> acc(p.q_block * ld_grad), row_dot(p.q_block), row_lse_inf(p.q_block);
    // float32: the query block's rows and their output gradients, transposed for the products.
    Buffer<float> query_t(reduced ? 0 : d * p.q_block), grad_out_t(reduced ? 0 : d * p.q_block);
    // Reduced precision: the query block and its output gradients packed as B operands; keys and values packed; the
    // probabilities and score gradients rounded for their products, as rows and transposed.
    const int64_t reduced_size = reduced ? 1 : 0;
    Buffer<T> query_packed(reduced_size * blocks_size(p.q_block, d));
    Buffer<T> grad_packed(reduced_size * blocks_size(p.q_block, d));
    Buffer<T> key_panels(reduced_size * panels_size(Lk, d)), value_panels(reduced_size * panels_size(Lk, d));
    Buffer<T> key_blocks(reduced_size * blocks_size(Lk, d));
    Buffer<T> kept(reduced_size * p.q_block * ld_kept), grad_kept(reduced_size * p.q_block * ld_kept);
    Buffer<T> kept_t(reduced_size * p.kv_block * ld_kept_t), grad_kept_t(reduced_size * p.kv_block * ld_kept_t);
    Buffer<T> rounded_bucket(reduced_size * p.q_block * even(R));
    std::vector<uint32_t> row_keys(p.q_block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / H, h = task % H;
      const T* qh = q + b * query.stride(0) + h * query.stride(1);
      const T* kh = k + b * key.stride(0) + h * key.stride(1);
      const T* vh = v + b * value.stride(0) + h * value.stride(1);
      const T* goh = go + b * grad_out.stride(0) + h * grad_out.stride(1);
      const T* oh = o + b * out.stride(0) + h * out.stride(1);
      float* gqh = gq + b * Lq * gs + h * d;
      float *gkh = gk + (b * H + h) * ld_grad * Lk, *gvh = gv + (b * H + h) * ld_grad * Lk;
      if constexpr (reduced) {
        pack_rows(kh, ks, Lk, d, p.kv_block, key_panels.data(), key_blocks.data());
        pack_rows(vh, vs, Lk, d, p.kv_block, value_panels.data(), static_cast<T*>(nullptr));
      }
      for (int64_t m = 0; m < Lq; m += p.q_block) {
        if (p.interruption->check()) break;
        const int64_t qb = std::min(p.q_block, Lq - m);
        const T* qm = qh + m * qs;
        const T* gom = goh + m * gos;
        if constexpr (reduced) {
          pack_rows(qm, qs, qb, d, p.q_block, static_cast<T*>(nullptr), query_packed.data());
          pack_rows(gom, gos, qb, d, p.q_block, static_cast<T*>(nullptr), grad_packed.data());
        } else {
          for (int64_t r = 0; r < qb; ++r)
            for (int64_t x = 0; x < d; ++x) {
              query_t[x * qb + r] = qm[r * qs + x];
              grad_out_t[x * qb + r] = gom[r * gos + x];
            }
        }
        table.terms(qb, qm, qs, qt.data());
        table.terms(qb, gom, gos, grad_terms.data());  // dO . T[p]
        for (int64_t x = 0; x < qb * table.ld; ++x) qt[x] *= p.scale;
        for (int64_t r = 0; r < qb; ++r) {
          row_dot[r] = 0.0f;  // D_i = dO_i . O_i (the output already holds the dropped probabilities)
          for (int64_t x = 0; x < d; ++x)
            row_dot[r] += static_cast<float>(gom[r * gos + x]) * static_cast<float>(oh[(m + r) * os + x]);
          const float value_lse = lse_data[(b * H + h) * Lq + m + r];
          row_lse_inf[r] = value_lse == kNegInf ? -kNegInf : value_lse;  // empty rows: every probability 0
          if (p.dropout) row_keys[r] = p.row_key(b * H + h, p.offset + m + r);
        }
        std::fill(grad_bucket.begin(), grad_bucket.end(), 0.0f);
        std::fill(acc.begin(), acc.end(), 0.0f);
        const int64_t keys = p.keys_for(b, p.offset + m + qb);
        for (int64_t n = 0; n < keys; n += p.kv_block) {
          const int64_t kb = std::min(p.kv_block, keys - n);
          const int64_t ld = reduced ? ld_scores : kb;
          if constexpr (reduced) {
            row_panels(key_panels.data(), Lk, d, p.kv_block).multiply(qb, qm, qs, n, kb, probs.data(), ld, false);
            row_panels(value_panels.data(), Lk, d, p.kv_block).multiply(qb, gom, gos, n, kb, grad_scores.data(), ld, false);
          } else {
            gemm(qb, kb, d, qm, qs, key_t.data_ptr<float>() + (b * H + h) * d * Lk + n, Lk, probs.data(), kb, false);
            gemm(qb, kb, d, gom, gos, value_t.data_ptr<float>() + (b * H + h) * d * Lk + n, Lk, grad_scores.data(), kb,
                 false);
          }
          for (int64_t r = 0; r < qb; ++r) {
            const int64_t i = p.offset + m + r;
            float* prob = probs.data() + r * ld;
            float* grad = grad_scores.data() + r * ld;
            const float *terms = qt.data() + r * table.ld, *value_terms = grad_terms.data() + r * table.ld;
            const float lse_i = row_lse_inf[r], dot = row_dot[r];
            p.apply_mask(prob, b, i, n, kb);
            float* row_bucket = grad_bucket.data() + r * R;
            p.for_each_range(i, n, kb, [&](int64_t start, int64_t stop, int64_t first, auto step) {
              // dP~_ij = dO_i . (v_j + T[r(i, j)]), and dS = P (dP - D).
              if (!p.dropout) {
                const float range_sum = score_gradients<step>(prob + start, grad + start, terms + first + step * start,
                                                              value_terms + first + step * start, p.scale, lse_i, dot,
                                                              row_bucket + first + start, stop - start);
                if constexpr (!step) row_bucket[first] += range_sum;
                return;
              }
              // With dropout dP_ij = dP~_ij z_ij, z = keep / (1 - p); the value gradient takes P z.
              const uint32_t key = row_keys[r];
              float range_sum = 0.0f;
#pragma omp simd reduction(+ : range_sum)
              for (int64_t c = start; c < stop; ++c) {
                const float e = fast_exp(prob[c] * p.scale + terms[first + step * c] - lse_i);
                const float z = p.keep_factor(key, n + c);
                grad[c] = e * (z * (grad[c] + value_terms[first + step * c]) - dot);
                prob[c] = e * z;
                range_sum += grad[c];
              }
              add_to_bucket(row_bucket, grad, start, stop, first, step, range_sum);
            });
            if constexpr (reduced) {  // dS as the A operand against the packed key block: zero past the visible keys
              T* row = grad_kept.data() + r * ld_kept;
              convert(grad, row, kb);
              std::fill(row + kb, row + even(std::min(p.kv_block, Lk - n)), T(0));
              convert(prob, kept.data() + r * ld_kept, kb);
            }
          }
          if constexpr (reduced) {
            transpose(kept.data(), ld_kept, qb, kb, kept_t.data(), ld_kept_t);
            transpose(grad_kept.data(), ld_kept, qb, kb, grad_kept_t.data(), ld_kept_t);
            if (qb & 1)
              for (int64_t c = 0; c < kb; ++c) kept_t[c * ld_kept_t + qb] = grad_kept_t[c * ld_kept_t + qb] = T(0);
            const Packed<T> grad_out_block = row_block(grad_packed.data(), qb, d, p.q_block, 0);
            const Packed<T> query_block = row_block(query_packed.data(), qb, d, p.q_block, 0);
            grad_out_block.multiply(kb, kept_t.data(), ld_kept_t, 0, d, gvh + n * ld_grad, ld_grad, true);  // dV += P^T dO
            row_block(key_blocks.data(), Lk, d, p.kv_block, n)
                .multiply(qb, grad_kept.data(), ld_kept, 0, d, acc.data(), ld_grad, true);  // acc += dS K
            query_block.multiply(kb, grad_kept_t.data(), ld_kept_t, 0, d, gkh + n * ld_grad, ld_grad, true);  // dK += dS^T Q
          } else {
            gemm(d, kb, qb, grad_out_t.data(), qb, probs.data(), kb, gvh + n, Lk, true);  // dV^T += dO^T P
            gemm(qb, d, kb, grad_scores.data(), kb, kh + n * ks, ks, acc.data(), d, true);
            gemm(d, kb, qb, query_t.data(), qb, grad_scores.data(), kb, gkh + n, Lk, true);  // dK^T += Q^T dS
          }
        }
        // dq_i = scale * (sum_j dS_ij k_j + sum_p bucket_ip T[p])
        table.add_value_term(qb, grad_bucket.data(), rounded_bucket.data(), acc.data(), ld_grad);
        for (int64_t r = 0; r < qb; ++r)
          for (int64_t x = 0; x < d; ++x) gqh[(m + r) * gs + x] = p.scale * acc[r * ld_grad + x];
      }
    }
    if constexpr (reduced) cpublas::brgemm_release();
  });
  // dK = scale * dS^T Q; both back to [B, Lk, H, d].
  if constexpr (reduced)
    return {grad_query, grad_key.narrow(3, 0, d).mul_(p.scale).permute({0, 2, 1, 3}).contiguous(),
            grad_value.narrow(3, 0, d).permute({0, 2, 1, 3}).contiguous()};
  return {grad_query, grad_key.mul_(p.scale).permute({0, 3, 1, 2}).contiguous(),
          grad_value.permute({0, 3, 1, 2}).contiguous()};
}

// The call's operands in the type its routine computes in: float32, unless the reduced-precision products run.
at::Tensor as_computed(const at::Tensor& t, Routine routine) {
  return rows_usable(routine == kFloat32 ? t.to(at::kFloat) : t);
}

}  // namespace

// K of a [2K + 1, head_size] table.
int64_t max_relative_position(const at::Tensor& table) { return (table.size(0) - 1) / 2; }

// Returns (out [B, Lq, H, d] contiguous in the query's type, lse [B, H, Lq] float32); a row that sees no key gets
// out 0, lse -inf.
std::vector<at::Tensor> forward(const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
                                const at::Tensor& table, const Asked& asked, int64_t q_block, int64_t kv_block,
                                Interruption& interruption) {
  const at::Tensor T = table.contiguous();
  check_inputs(query_in, key_in, value_in, T, asked);
  const Routine routine = products_for(query_in.scalar_type());
  const at::Tensor query = as_computed(query_in, routine), key = as_computed(key_in, routine);
  const at::Tensor value = as_computed(value_in, routine);
  const Problem p = make_problem(query, key, max_relative_position(T), asked, q_block, kv_block, routine, interruption);
  auto out = at::empty({p.B, p.Lq, p.H, p.d}, query.options());
  auto lse = at::empty({p.B, p.H, p.Lq}, query.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "nezha_forward", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) forward_impl<scalar_t>(p, query, key, value, T, out, lse);
  });
  routine_counts[routine] += 1;
  return {out.to(query_in.scalar_type()), lse};
}

// Gradients of query [B, Lq, H, d], key and value [B, Lk, H, d] (float32, contiguous), given the forward's output and
// lse.
std::vector<at::Tensor> backward(const at::Tensor& grad_out_in, const at::Tensor& query_in, const at::Tensor& key_in,
                                 const at::Tensor& value_in, const at::Tensor& out_in, const at::Tensor& lse,
                                 const at::Tensor& table, const Asked& asked, int64_t q_block, int64_t kv_block,
                                 Interruption& interruption) {
  const at::Tensor T = table.contiguous();
  check_inputs(query_in, key_in, value_in, T, asked);
  TORCH_CHECK(grad_out_in.sizes() == query_in.sizes() && out_in.sizes() == query_in.sizes(),
              "NEZHA kernel: the output and its gradient must be shaped like the query");
  const Routine routine = products_for(query_in.scalar_type());
  const at::Tensor query = as_computed(query_in, routine), key = as_computed(key_in, routine);
  const at::Tensor value = as_computed(value_in, routine), grad_out = as_computed(grad_out_in, routine);
  const at::Tensor out = as_computed(out_in.to(query_in.scalar_type()), routine);
  const Problem p = make_problem(query, key, max_relative_position(T), asked, q_block, kv_block, routine, interruption);
  std::vector<at::Tensor> grads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "nezha_backward", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>)
      grads = backward_impl<scalar_t>(p, grad_out, query, key, value, out, lse.contiguous(), T);
  });
  routine_counts[routine] += 1;
  return grads;
}

// The routine that multiplies the blocks of a call with inputs of `type` ("float32", "bfloat16", "float16") here.
std::string routine_for(const std::string& type) {
  const at::ScalarType scalar = type == "bfloat16" ? at::kBFloat16 : type == "float16" ? at::kHalf : at::kFloat;
  return kRoutineNames[products_for(scalar)];
}

// How many forward and backward calls each routine has run in this process.
std::map<std::string, int64_t> routine_calls() {
  std::map<std::string, int64_t> calls;
  for (int r = 0; r < kRoutines; ++r) calls[kRoutineNames[r]] = routine_counts[r].load();
  return calls;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // The problem is read with the GIL held; it is released while the kernel runs, so other Python threads go on (and
  // taken back between tasks only to run pending signal handlers).
  module.def(
      "forward",
      [](const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& table,
         const pybind11::object& problem, int64_t q_block, int64_t kv_block) {
        const Asked asked = read_problem(problem);
        Interruption interruption;
        std::vector<at::Tensor> result;
        {
          pybind11::gil_scoped_release release;
          result = forward(query, key, value, table, asked, q_block, kv_block, interruption);
        }
        if (interruption.raised) throw pybind11::error_already_set();  // the signal handler's exception
        return result;
      },
      "NEZHA relative attention forward (query, key, value, table, AttentionProblem, query block, key block): "
      "(out [B, Lq, H, d], lse [B, H, Lq])");
  module.def(
      "backward",
      [](const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
         const at::Tensor& out, const at::Tensor& lse, const at::Tensor& table, const pybind11::object& problem,
         int64_t q_block, int64_t kv_block) {
        const Asked asked = read_problem(problem);
        Interruption interruption;
        std::vector<at::Tensor> result;
        {
          pybind11::gil_scoped_release release;
          result = backward(grad_out, query, key, value, out, lse, table, asked, q_block, kv_block, interruption);
        }
        if (interruption.raised) throw pybind11::error_already_set();
        return result;
      },
      "NEZHA relative attention backward: grads of query, key, value as [B, L, H, d]");
  module.def("routine_for", &routine_for, "the routine that multiplies the blocks of a call in this type here");
  module.def("routine_calls", &routine_calls, "forward and backward calls per routine in this process");
}
