// The tiled position lambdas in bfloat16 by oneDNN's BRGEMM micro-kernel (torch's at::native::cpublas::brgemm):
// AMX tiles where the CPU has AMX-BF16 (and oneDNN may use it), else oneDNN's AVX-512 BF16 micro-kernel; compiled
// where the compiler targets AVX-512 BF16 (tiled_cpu.h says what the kernels compute).
//
// Every product is one BRGEMM call of a block of queries: R query rows x nq queries along a row, all heads, M = R h
// nq rows (r, head, qx). A query's scope row is a contiguous run of K_w columns of a value row, and the runs of the
// block's queries lie in one band of Wb = s (nq - 1) + K_w columns (s = step; rounded up to 16: 64-byte operand rows)
// : the values are laid out once per call in column strips, strip i holding the Wb columns from s nq i of every
// padded value row, so that the block's KR = s (R - 1) + K_h value rows are one contiguous operand of K = KR Wb rows.
// Each query's logits then sit in its own K_w-column segment of each row of the band (zero elsewhere), and the
// aggregation y = L v is one GEMM of depth KR Wb
// (a K_w / Wb share of it nonzero: 23 / 32 at stride 1, 25 / 32 at the patched stride 2). The backward is four more:
// the logit gradients gy v^T over the same band, the value gradients gy^T L into strip accumulators, then dq = dL R^T
// and dR += q^T dL; the content lambda (eq. 2) adds q lambda^c, gy lambda^c^T and q^T gy to the same accumulators.
//
// As a bfloat16 matmul computes: products of bfloat16 operands summed in float32, the logits rounded to bfloat16
// before the aggregation and the value gradients, the logit gradients rounded to bfloat16 before dq and dR, each
// result rounded once (the output to bfloat16; the gradients returned in float32, rounded by the caller).
// Operand layouts: A row-major [M, K]; B in oneDNN's VNNI layout, pairs of the reduced dimension interleaved: element
// (k, n) at ((k / 2) ldb + n) 2 + k % 2 ("VNNI over k").
#include "tiled_cpu.h"
#if defined(__AVX512BF16__)
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {
using namespace tiled_cpu;
using u16 = uint16_t;

// A vector on 64-byte boundaries: the operands' rows start on cache lines (with the leading dimensions below), which
// AMX's tile loads need to run at full speed (a B operand 16 bytes off its line ran the products 2-5x slower)
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <typename T>
using Buf = std::vector<T, Aligned64<T>>;

// C [M, N] (+)= A [M, K] (lda) B (VNNI over k, ldb) in float32 (ldc); K even
inline void mm(int64_t M, int64_t N, int64_t K, const u16* A, int64_t lda, const u16* B, int64_t ldb, float* C,
               int64_t ldc, bool add) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!add)
      for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, N * sizeof(float));
    return;
  }
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, reinterpret_cast<const at::BFloat16*>(A),
                              reinterpret_cast<const at::BFloat16*>(B), C, true);
}

// dst[i ds + e] = bfloat16(src[i ss + e]) (round to nearest even), e < n, i < rows: 32 at a time, the last 32
// masked (reads and writes nothing past the n of a row)
inline void segments_to_bf16(const float* src, int64_t ss, u16* dst, int64_t ds, int64_t n, int64_t rows) {
  const int64_t full = n / 32 * 32, tail = n - full;
  const __mmask32 k = __mmask32((uint64_t(1) << tail) - 1);
  const __mmask16 lo = __mmask16(k & 0xffff), hi = __mmask16(k >> 16);
  for (int64_t i = 0; i < rows; ++i, src += ss, dst += ds) {
    for (int64_t e = 0; e < full; e += 32)
      _mm512_storeu_si512(dst + e,
                          (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + e + 16), _mm512_loadu_ps(src + e)));
    if (tail)
      _mm512_mask_storeu_epi16(dst + full, k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, src + full + 16),
                                                                          _mm512_maskz_loadu_ps(lo, src + full)));
  }
}

// out[2 i] = a[i], out[2 i + 1] = b[i], i < n (a or b null: zeros): two rows as one VNNI pair row
inline void interleave(const u16* a, const u16* b, u16* out, int64_t n) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx), zero = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i x = a ? _mm512_loadu_si512(a + i) : zero, y = b ? _mm512_loadu_si512(b + i) : zero;
    _mm512_storeu_si512(out + 2 * i, _mm512_permutex2var_epi16(x, lo, y));
    _mm512_storeu_si512(out + 2 * i + 32, _mm512_permutex2var_epi16(x, hi, y));
  }
  for (; i < n; ++i) {
    out[2 * i] = a ? a[i] : 0;
    out[2 * i + 1] = b ? b[i] : 0;
  }
}

// dst[c ld_d + r] = src[r ld_s + c], r < rows, c < cols (16-bit elements): 8 rows x 32 columns at a time as four
// 8 x 8 transposes in the 128-bit lanes (three rounds of unpacks), the rest one by one
inline void transpose16(const u16* src, int64_t ld_s, int64_t rows, int64_t cols, u16* dst, int64_t ld_d) {
  int64_t r0 = 0;
  for (; r0 + 8 <= rows; r0 += 8)
    for (int64_t c0 = 0; c0 < cols; c0 += 32) {
      const int64_t n = std::min<int64_t>(32, cols - c0);
      const __mmask32 k = __mmask32((uint64_t(1) << n) - 1);
      __m512i x[8], y[8];
      for (int i = 0; i < 8; ++i) x[i] = _mm512_maskz_loadu_epi16(k, src + (r0 + i) * ld_s + c0);
      for (int i = 0; i < 8; i += 2) {  // pairs of rows by 16 bits
        y[i] = _mm512_unpacklo_epi16(x[i], x[i + 1]);
        y[i + 1] = _mm512_unpackhi_epi16(x[i], x[i + 1]);
      }
      for (int i = 0; i < 8; i += 4)  // quads by 32 bits: y0 y2 -> columns 0-1, 2-3; y1 y3 -> 4-5, 6-7
        for (int j = 0; j < 2; ++j) {
          x[i + 2 * j] = _mm512_unpacklo_epi32(y[i + j], y[i + j + 2]);
          x[i + 2 * j + 1] = _mm512_unpackhi_epi32(y[i + j], y[i + j + 2]);
        }
      for (int i = 0; i < 4; ++i) {  // rows 0-3 and 4-7 by 64 bits: column 2 i, 2 i + 1 of each lane
        y[2 * i] = _mm512_unpacklo_epi64(x[i], x[i + 4]);
        y[2 * i + 1] = _mm512_unpackhi_epi64(x[i], x[i + 4]);
      }
      // y[c] lane L: column c0 + 8 L + c of the 8 rows
      for (int c = 0; c < 8; ++c) {
        const __m128i lane[4] = {_mm512_extracti32x4_epi32(y[c], 0), _mm512_extracti32x4_epi32(y[c], 1),
                                 _mm512_extracti32x4_epi32(y[c], 2), _mm512_extracti32x4_epi32(y[c], 3)};
        for (int L = 0; L < 4 && 8 * L + c < n; ++L)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (c0 + 8 * L + c) * ld_d + r0), lane[L]);
      }
    }
  for (int64_t r = r0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_d + r] = src[r * ld_s + c];
}

// A pair of logit rows' segments in a band VNNI over its rows: out[2 i] = bfloat16(a[i]) for i < n, out[2 i + 1] =
// bfloat16(b[i - d]) for d <= i < d + n, the rest of the d + n pairs zero; 32 pairs at a time, masked (reads nothing
// outside a's and b's n, writes only the d + n pairs)
inline void pair_segments(const float* a, const float* b, int64_t n, int64_t d, u16* out) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  auto lanes = [](int64_t from, int64_t to) {  // mask of the lanes [from, to) of 32
    from = std::max<int64_t>(0, from), to = std::min<int64_t>(32, to);
    return to <= from ? __mmask32(0) : __mmask32(((uint64_t(1) << (to - from)) - 1) << from);
  };
  auto load32 = [](const float* p, __mmask32 k) {  // lanes k of p[0, 32) as bfloat16, the others zero
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(__mmask16(k >> 16), p + 16),
                                        _mm512_maskz_loadu_ps(__mmask16(k & 0xffff), p));
  };
  for (int64_t i0 = 0; i0 < d + n; i0 += 32) {
    const __m512i x = load32(a + i0, lanes(0, n - i0)), y = load32(b + i0 - d, lanes(d - i0, d + n - i0));
    const int64_t pairs = std::min<int64_t>(32, d + n - i0);
    _mm512_mask_storeu_epi16(out + 2 * i0, lanes(0, 2 * pairs), _mm512_permutex2var_epi16(x, lo, y));
    _mm512_mask_storeu_epi16(out + 2 * i0 + 32, lanes(0, 2 * pairs - 32), _mm512_permutex2var_epi16(x, hi, y));
  }
}

// The blocking of a call: blocks of R query rows x nq queries (all heads), the value strips (the Wb columns from
// s nq i of every padded value row: padded row p is image row p - y_lo, padded column image column + x_lo)
struct Geo {
  int64_t B, H, C, Ho, Wo, U, KH, KW, V, Hh, Ww, CV, s, y_lo, x_lo, Rn;
  int64_t Cp, Vp, Rnp;          // C, V even; Rn a multiple of 32 (zero padded)
  int64_t nq, R, M, Wb, KR, Kb;  // block: queries along a row (even), rows, M = R H nq; band columns, rows, K
  int64_t NS, NRB, Hp, Kt;       // strips, row blocks, padded value rows (all row blocks whole), K of a strip
  // (block: [queries along a row, rows], 0 for the default; queries rounded up to even)
  Geo(const torch::Tensor& q, const torch::Tensor& v, const torch::Tensor& table, int64_t step,
      c10::IntArrayRef block) {
    B = q.size(0); H = q.size(1); C = q.size(2); Ho = q.size(3); Wo = q.size(4);
    U = table.size(1); KH = table.size(2); KW = table.size(3); CV = v.size(1); V = CV / U; Hh = v.size(2);
    Ww = v.size(3); s = step; y_lo = (KH - 1) / 2; x_lo = (KW - 1) / 2; Rn = U * KH * KW;
    Cp = round_up(C, 2); Vp = round_up(V, 2); Rnp = round_up(Rn, 32);
    // a block's K_h K_w / (KR Wb) of its aggregation is work, the rest zeros: 8 queries x 4 rows of 4 heads at stride
    // 1 (23 / 32 of the band's columns and 23 / 26 of its rows at a 23 x 23 scope), 4 x 4 at stride 2 (25 / 32 and
    // 25 / 31 at the patched 25 x 25), M = 128 and 64
    nq = std::min<int64_t>(s == 1 ? 8 : 4, round_up(Wo, 2));
    R = std::max<int64_t>(1, std::min(Ho, 128 / s / (H * nq)));
    if (block.size() == 2 && block[0] > 0) nq = round_up(block[0], 2);
    if (block.size() == 2 && block[1] > 0) R = block[1];
    M = R * H * nq;  // even: nq is
    Wb = round_up(s * (nq - 1) + KW, 16);  // (64-byte rows of the B operands, VNNI: below)
    KR = s * (R - 1) + KH;
    Kb = KR * Wb;
    NS = (Wo + nq - 1) / nq;
    NRB = (Ho + R - 1) / R;
    Hp = s * (NRB * R - 1) + KH;
    Kt = Hp * Wb;
  }
  // the padded value rows [y0, y1) of row block rb that meet the image (relative to the block's first, s R rb)
  std::pair<int64_t, int64_t> rows(int64_t rb) const {
    const int64_t ya = s * R * rb;
    return {std::max<int64_t>(0, y_lo - ya), std::min<int64_t>(KR, y_lo + Hh - ya)};
  }
};

// The forward strips: F[b, u, i] [Kt / 2, V, 2] bfloat16, VNNI over k = (padded row, strip column): the values of
// strip i as the B operand of the aggregation (K = k, N = V); from v channels last [B, H, W, CV]
torch::Tensor forward_strips(const Geo& g, const torch::Tensor& vcl) {
  auto F = torch::empty({g.B, g.U, g.NS, g.Kt * g.V}, vcl.options());
  const u16* src = reinterpret_cast<const u16*>(vcl.data_ptr<at::BFloat16>());
  u16* dst = reinterpret_cast<u16*>(F.data_ptr<at::BFloat16>());
  at::parallel_for(0, g.B * g.U * g.NS * g.Hp, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i % g.Hp, sx = i / g.Hp % g.NS, u = i / (g.Hp * g.NS) % g.U, b = i / (g.Hp * g.NS * g.U);
      u16* row = dst + ((b * g.U + u) * g.NS + sx) * g.Kt * g.V + p * g.Wb * g.V;
      const int64_t y = p - g.y_lo, x0 = sx * g.s * g.nq - g.x_lo;
      auto at = [&](int64_t x) -> const u16* {
        return y >= 0 && y < g.Hh && x >= 0 && x < g.Ww ? src + ((b * g.Hh + y) * g.Ww + x) * g.CV + u * g.V : nullptr;
      };
      for (int64_t c = 0; c < g.Wb; c += 2) interleave(at(x0 + c), at(x0 + c + 1), row + c * g.V, g.V);
    }
  });
  return F;
}

// The backward strips: T[b, u, i] [Vp / 2, Kt, 2] bfloat16, VNNI over the channels: strip i's values as the B
// operand of the logit gradients (K = channels, N = k); from v [B, CV, H, W] contiguous
torch::Tensor backward_strips(const Geo& g, const torch::Tensor& v) {
  auto T = torch::empty({g.B, g.U, g.NS, g.Vp * g.Kt}, v.options());
  const u16* src = reinterpret_cast<const u16*>(v.data_ptr<at::BFloat16>());
  u16* dst = reinterpret_cast<u16*>(T.data_ptr<at::BFloat16>());
  const int64_t VP = g.Vp / 2;
  at::parallel_for(0, g.B * g.U * g.NS * VP, 1, [&](int64_t begin, int64_t end) {
    std::vector<u16> ra(g.Wb), rb(g.Wb);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t jp = i % VP, sx = i / VP % g.NS, u = i / (VP * g.NS) % g.U, b = i / (VP * g.NS * g.U);
      u16* out = dst + ((b * g.U + u) * g.NS + sx) * g.Vp * g.Kt + jp * g.Kt * 2;
      const int64_t x0 = sx * g.s * g.nq - g.x_lo, c0 = std::max<int64_t>(0, -x0);
      const int64_t c1 = std::max(c0, std::min(g.Wb, g.Ww - x0));
      const bool second = 2 * jp + 1 < g.V;
      for (int64_t p = 0; p < g.Hp; ++p) {
        const int64_t y = p - g.y_lo;
        if (y < 0 || y >= g.Hh) {
          std::memset(out + p * g.Wb * 2, 0, g.Wb * 2 * sizeof(u16));
          continue;
        }
        const u16* a = src + ((b * g.CV + u * g.V + 2 * jp) * g.Hh + y) * g.Ww;  // image row y of channel 2 jp
        std::fill(ra.begin(), ra.end(), 0);
        std::fill(rb.begin(), rb.end(), 0);
        std::memcpy(ra.data() + c0, a + x0 + c0, (c1 - c0) * sizeof(u16));
        if (second) std::memcpy(rb.data() + c0, a + g.Hh * g.Ww + x0 + c0, (c1 - c0) * sizeof(u16));
        interleave(ra.data(), rb.data(), out + p * g.Wb * 2, g.Wb);
      }
    }
  });
  return T;
}

// x [n, rows, cols] bfloat16 (any strides) as n B operands VNNI over their rows: [n, rows_p / 2, cols_p, 2], zero
// past x's rows and columns (rows_p even); on the calling thread, one pass (tables and content lambdas: small; ATen's
// permuted copy of a 8 x 529 x 2 table took 0.4 ms)
torch::Tensor vnni_rows(const torch::Tensor& x, int64_t rows_p, int64_t cols_p) {
  const int64_t n = x.size(0), rows = x.size(1), cols = x.size(2);
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  auto out = torch::empty({n, rows_p / 2, cols_p, 2}, x.options());
  const u16* src = reinterpret_cast<const u16*>(x.data_ptr<at::BFloat16>());
  u16* dst = reinterpret_cast<u16*>(out.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < rows_p; ++r) {
      u16* d = dst + (i * rows_p / 2 + r / 2) * cols_p * 2 + r % 2;
      const u16* row = src + i * s0 + r * s1;
      const int64_t valid = r < rows ? cols : 0;
      for (int64_t c = 0; c < valid; ++c) d[2 * c] = row[c * s2];
      for (int64_t c = valid; c < cols_p; ++c) d[2 * c] = 0;
    }
  return out;
}

// A map x [B, h, n, Ho, Wo] (contiguous) as its blocks' transposes, [B, NRB, n, NS M + 32]: block (b, rb, sx) is
// xT[c, m] = x[b, h, c, oy0 + r, ox0 + qx] at (b, rb, c, sx M + m) (m = (r h + h') nq + qx, oy0 = R rb, ox0 = nq sx;
// 0 past the map), rows ld() apart. Made and read back in one pass over the map's rows on all threads, a map row's
// runs side by side (gathered block by block, the 16-byte runs of a block's n h R map rows, 8 KiB apart at 64 x 64,
// evict each other from the cache: 3x the time); rows a cache line longer than NS M (a multiple of 4 KiB at 64 x 64,
// whose rows would share the sets of the L1 cache in the GEMMs' tile loads).
struct Blocks {
  const Geo& g;
  int64_t n;
  int64_t ld() const { return g.NS * g.M + 32; }
  int64_t size() const { return g.B * g.NRB * n * ld(); }
  int64_t at(int64_t b, int64_t rb, int64_t sx) const { return (b * g.NRB + rb) * n * ld() + sx * g.M; }
  int64_t at(int64_t i) const { return at(i / (g.NS * g.NRB), i / g.NS % g.NRB, i % g.NS); }  // block i: (b, rb, sx)
};

torch::Tensor to_blocks(const Geo& g, const torch::Tensor& x, int64_t n) {
  const Blocks bl{g, n};
  auto out = torch::empty({bl.size()}, x.options());
  const u16* src = reinterpret_cast<const u16*>(x.data_ptr<at::BFloat16>());
  u16* dst = reinterpret_cast<u16*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, g.B * g.H * n * g.NRB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i % g.H, rb = i / g.H % g.NRB, c = i / (g.H * g.NRB) % n, b = i / (g.H * g.NRB * n);
      for (int64_t r = 0; r < g.R; ++r) {
        const int64_t oy = rb * g.R + r;
        const u16* row = src + ((b * g.H + h) * n + c) * g.Ho * g.Wo + oy * g.Wo;
        for (int64_t sx = 0; sx < g.NS; ++sx) {
          u16* d = dst + bl.at(b, rb, sx) + c * bl.ld() + (r * g.H + h) * g.nq;
          const int64_t valid = oy < g.Ho ? std::min(g.nq, g.Wo - sx * g.nq) : 0;
          for (int64_t qx = 0; qx < valid; ++qx) d[qx] = row[sx * g.nq + qx];
          for (int64_t qx = valid; qx < g.nq; ++qx) d[qx] = 0;
        }
      }
    }
  });
  return out;
}

// x [B, h, n, Ho, Wo] from its blocks' transposes (to_blocks' layout), on all threads
void from_blocks(const Geo& g, const u16* blocks, int64_t n, u16* x) {
  const Blocks bl{g, n};
  at::parallel_for(0, g.B * g.H * n * g.NRB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i % g.H, rb = i / g.H % g.NRB, c = i / (g.H * g.NRB) % n, b = i / (g.H * g.NRB * n);
      for (int64_t r = 0; r < g.R && rb * g.R + r < g.Ho; ++r) {
        u16* row = x + ((b * g.H + h) * n + c) * g.Ho * g.Wo + (rb * g.R + r) * g.Wo;
        for (int64_t sx = 0; sx < g.NS; ++sx) {
          const u16* s = blocks + bl.at(b, rb, sx) + c * bl.ld() + (r * g.H + h) * g.nq;
          const int64_t valid = std::min(g.nq, g.Wo - sx * g.nq);
          for (int64_t qx = 0; qx < valid; ++qx) row[sx * g.nq + qx] = s[qx];
        }
      }
    }
  });
}

// The per-block operands a thread reuses: the queries [M, Cp] (A of the logits; QT [C, M], to_blocks', A of dR),
// the logits [M, Rnp] in float32, the band of each |u| [U, M, Kb] bfloat16 (zero outside each query's segments)
struct Block {
  const Geo& g;
  const u16* QT = nullptr;
  Buf<u16> Q, Lb;
  Buf<float> L;
  explicit Block(const Geo& geo) : g(geo), Q(g.M * g.Cp, 0), Lb(g.U * g.M * g.Kb, 0), L(g.M * g.Rnp) {}
  // block i's queries (from their blocks, to_blocks: rows ld apart)
  void queries(const u16* qb, int64_t i, int64_t ld) {
    QT = qb + Blocks{g, g.C}.at(i);
    transpose16(QT, ld, g.C, g.M, Q.data(), g.Cp);
  }
  // the logits L = Q R and each |u|'s band: Lb[u, m, (s r + ky) Wb + s qx + kx] = bfloat16(L[m, (u, ky, kx)]), or
  // where vnni, VNNI over m: [U, M / 2, Kb, 2] (the B of the value gradients; rows 2 p and 2 p + 1 are the queries qx
  // and qx + 1 of one head and row, their segments s apart)
  void logits(const u16* RV, bool vnni = false) {
    mm(g.M, g.Rnp, g.Cp, Q.data(), g.Cp, RV, g.Rnp, L.data(), g.Rnp, false);
    for (int64_t u = 0; u < g.U; ++u)
      for (int64_t m = 0; m < g.M; m += vnni ? 2 : 1) {
        const int64_t r = m / (g.H * g.nq), qx = m % g.nq, k = g.s * r * g.Wb + g.s * qx;
        const float* src = L.data() + m * g.Rnp + u * g.KH * g.KW;
        if (!vnni) {
          segments_to_bf16(src, g.KW, Lb.data() + (u * g.M + m) * g.Kb + k, g.Wb, g.KW, g.KH);
          continue;
        }
        u16* dst = Lb.data() + (u * g.M + m) * g.Kb + 2 * k;  // pair m / 2, column k
        for (int64_t ky = 0; ky < g.KH; ++ky)
          pair_segments(src + ky * g.KW, src + g.Rnp + ky * g.KW, g.KW, g.s, dst + 2 * ky * g.Wb);
      }
  }
};

// every tensor read, checked against the others (check_arguments, tiled_cpu.h), bfloat16; block [] or [queries, rows]
void check_inputs(const char* name, const torch::Tensor& q, const torch::Tensor& v, const torch::Tensor& table,
                  const std::optional<torch::Tensor>& content, int64_t step, const torch::Tensor* gy,
                  const std::vector<int64_t>& block) {
  TORCH_CHECK_VALUE(block.empty() || (block.size() == 2 && block[0] >= 0 && block[1] >= 0 && block[0] <= 256 &&
                                      block[1] <= 256),
                    name, ": block is [] or [queries, rows] (0: the default), each at most 256, got ", block);
  check_arguments(name, q, v, table, content, step, gy, torch::kBFloat16);
}

// the content lambda [B, c, V] bfloat16 as B operands: [B, Cp / 2, V, 2] (VNNI over c: q lambda^c) and its
// transpose [B, Vp / 2, c, 2] (VNNI over V: gy lambda^c^T)
std::pair<torch::Tensor, torch::Tensor> content_operands(const std::optional<torch::Tensor>& content, const Geo& g,
                                                         bool transposed) {
  if (!content.has_value()) return {};
  const auto& lc = *content;
  TORCH_CHECK(lc.scalar_type() == torch::kBFloat16 && lc.device().is_cpu() && lc.dim() == 3 && lc.size(0) == g.B &&
                  lc.size(1) == g.C && lc.size(2) == g.V,
              "tiled_position_lambdas: content ", lc.sizes(), " is not a bfloat16 CPU tensor [", g.B, ", ", g.C, ", ",
              g.V, "]");
  return {vnni_rows(lc, g.Cp, g.V), transposed ? vnni_rows(lc.transpose(1, 2), g.Vp, g.C) : torch::Tensor()};
}

// brgemm_release on each thread that ran BRGEMM (the AMX tile configuration is per thread)
template <typename F>
void parallel_units(int64_t n, F body) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    body(begin, end);
    at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace

// Which micro-kernel computes the bfloat16 BRGEMM here: "amx" (oneDNN's AMX tiles: torch's could_pack), "avx512"
// (oneDNN's AVX-512 BF16 micro-kernel), or "" where oneDNN cannot run it (no AVX-512 BF16 for oneDNN, oneDNN capped
// below it, or torch.backends.mkldnn disabled), found by running one 16 x 16 x 32 product and checking it exactly
std::string brgemm_bf16_isa() {
  std::vector<u16> a(16 * 32), bv(16 * 32);
  std::vector<float> c(16 * 16, -1.f);
  for (int64_t m = 0; m < 16; ++m)
    for (int64_t k = 0; k < 32; ++k) a[m * 32 + k] = at::BFloat16(float((m + k) % 3 - 1)).x;
  for (int64_t k = 0; k < 32; ++k)
    for (int64_t n = 0; n < 16; ++n) bv[((k / 2) * 16 + n) * 2 + k % 2] = at::BFloat16(float((k * n) % 5 - 2)).x;
  try {
    mm(16, 16, 32, a.data(), 32, bv.data(), 16, c.data(), 16, false);
    at::native::cpublas::brgemm_release(true);
  } catch (const std::exception&) {
    return "";
  }
  for (int64_t m = 0; m < 16; ++m)
    for (int64_t n = 0; n < 16; ++n) {
      float want = 0;
      for (int64_t k = 0; k < 32; ++k) want += float((m + k) % 3 - 1) * float((k * n) % 5 - 2);
      if (c[m * 16 + n] != want) return "";
    }
  return at::native::cpublas::could_pack(at::kBFloat16) ? "amx" : "avx512";
}

// Whether this process may use AMX tile data (Linux: arch_prctl(ARCH_GET_XCOMP_PERM) has XFEATURE_XTILEDATA, bit 18;
// oneDNN requests it before its first AMX kernel)
bool amx_tile_data_permitted() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  uint64_t features = 0;
  if (syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &features) != 0) return false;
  return (features >> 18) & 1;
#else
  return false;
#endif
}

// q [B, h, c, Ho, Wo], v [B, u V, H, W], table [c, u, K_h, K_w], content [B, c, V] or None, bfloat16 -> y [B, h V,
// Ho, Wo] bfloat16: per block of queries the logits Q R (rounded to bfloat16), then y = q lambda^c + sum_u band_u
// strip_u, summed in float32 and rounded once
torch::Tensor tiled_forward_brgemm(torch::Tensor q, torch::Tensor v, torch::Tensor table,
                                   std::optional<torch::Tensor> content, int64_t step, std::vector<int64_t> block) {
  check_inputs("tiled_forward_brgemm", q, v, table, content, step, nullptr, block);
  q = q.contiguous();
  const Geo g(q, v, table, step, block);
  auto y = torch::empty({g.B, g.H * g.V, g.Ho, g.Wo}, v.options());
  if (y.numel() == 0) return y;
  auto RV = vnni_rows(table.reshape({1, g.C, g.Rn}), g.Cp, g.Rnp);  // [Cp / 2, Rnp, 2]
  const auto lc = content_operands(content, g, false).first;
  auto vcl = to_channels_last<at::BFloat16>(v);
  auto F = forward_strips(g, vcl);
  const Blocks qbl{g, g.C}, ybl{g, g.V};
  auto qb = to_blocks(g, q, g.C), yb = torch::empty({ybl.size()}, v.options());
  const u16* qd = reinterpret_cast<const u16*>(qb.data_ptr<at::BFloat16>());
  u16* ybd = reinterpret_cast<u16*>(yb.data_ptr<at::BFloat16>());
  const u16* RVd = reinterpret_cast<const u16*>(RV.data_ptr<at::BFloat16>());
  const u16* Fd = reinterpret_cast<const u16*>(F.data_ptr<at::BFloat16>());
  const u16* lcd = lc.defined() ? reinterpret_cast<const u16*>(lc.data_ptr<at::BFloat16>()) : nullptr;
  u16* yd = reinterpret_cast<u16*>(y.data_ptr<at::BFloat16>());
  parallel_units(g.B * g.NRB * g.NS, [&](int64_t begin, int64_t end) {
    Block blk(g);
    Buf<float> out(g.M * g.V);  // the block's output [M, V], then in bfloat16 (transposed: yb's block)
    Buf<u16> out16(g.M * g.V);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t sx = i % g.NS, rb = i / g.NS % g.NRB, b = i / (g.NS * g.NRB);
      const int64_t ya = g.s * g.R * rb;
      blk.queries(qd, i, qbl.ld());
      blk.logits(RVd);
      bool add = false;
      if (lcd != nullptr) {
        mm(g.M, g.V, g.Cp, blk.Q.data(), g.Cp, lcd + b * g.Cp * g.V, g.V, out.data(), g.V, false);
        add = true;
      }
      const auto [y0, y1] = g.rows(rb);
      for (int64_t u = 0; u < g.U; ++u) {
        const u16* strip = Fd + ((b * g.U + u) * g.NS + sx) * g.Kt * g.V;
        mm(g.M, g.V, (y1 - y0) * g.Wb, blk.Lb.data() + u * g.M * g.Kb + y0 * g.Wb, g.Kb,
           strip + (ya + y0) * g.Wb * g.V, g.V, out.data(), g.V, add);
        add = true;
      }
      if (!add) std::fill(out.begin(), out.end(), 0.f);
      segments_to_bf16(out.data(), g.V, out16.data(), g.V, g.V, g.M);
      transpose16(out16.data(), g.V, g.M, g.V, ybd + ybl.at(i), ybl.ld());
    }
  });
  from_blocks(g, ybd, g.V, yd);
  return y;
}

// gradients of tiled_forward_brgemm (gy, q, v, table, content bfloat16) in bfloat16 (summed in float32, rounded once),
// laid out as the inputs
// (gcontent empty without a content lambda): per block the logits again, then per |u| the value gradients
// gy^T band_u (into the strip's accumulators) and the logit gradients gy strip_u^T over the band, whose segments,
// rounded to bfloat16, give dq = dL R^T (+ gy lambda^c^T) and dR += Q^T dL (and dlambda^c += Q^T gy)
std::vector<torch::Tensor> tiled_backward_brgemm(torch::Tensor gy, torch::Tensor q, torch::Tensor v,
                                                 torch::Tensor table, std::optional<torch::Tensor> content,
                                                 int64_t step, std::vector<int64_t> block) {
  check_inputs("tiled_backward_brgemm", q, v, table, content, step, &gy, block);
  gy = gy.contiguous(); q = q.contiguous();
  const Geo g(q, v, table, step, block);
  TORCH_CHECK(gy.dim() == 4 && gy.size(0) == g.B && gy.size(1) == g.H * g.V && gy.size(2) == g.Ho &&
                  gy.size(3) == g.Wo,
              "tiled_backward_brgemm: gy ", gy.sizes(), " is not the output's [", g.B, ", ", g.H * g.V, ", ", g.Ho,
              ", ", g.Wo, "]");
  const auto opts = v.options();
  auto gq = torch::zeros({g.B, g.H, g.C, g.Ho, g.Wo}, opts);
  auto gv = torch::zeros({g.B, g.CV, g.Hh, g.Ww}, opts);
  auto gtable = torch::zeros({g.C, g.U, g.KH, g.KW}, opts);
  auto gcontent = torch::zeros(content.has_value() ? std::vector<int64_t>{g.B, g.C, g.V} : std::vector<int64_t>{0},
                               opts);
  if (gy.numel() == 0 || v.numel() == 0) return {gq, gv, gtable, gcontent};
  auto R2 = table.reshape({1, g.C, g.Rn});
  // [Cp / 2, Rnp, 2] (B of the logits), [Rnp / 2, C, 2] (B of dq)
  auto RV = vnni_rows(R2, g.Cp, g.Rnp), RTV = vnni_rows(R2.transpose(1, 2), g.Rnp, g.C);
  const auto [lc, lcT] = content_operands(content, g, true);
  auto T = backward_strips(g, v.contiguous());
  // work units: (image, strip, chunk of row blocks), each with its own value-gradient accumulators over the padded
  // rows its blocks reach, [U, V, rows Wb] float32 (transposed strips: C of gy^T band); enough units for the threads
  const int nthreads = at::get_num_threads();
  const int64_t chunks = std::min(g.NRB, std::max<int64_t>(1, (2 * nthreads + g.B * g.NS - 1) / (g.B * g.NS)));
  const int64_t per_chunk = (g.NRB + chunks - 1) / chunks, unit_rows = g.s * (per_chunk * g.R - 1) + g.KH;
  const int64_t units = g.B * g.NS * chunks, unit_k = unit_rows * g.Wb;
  Buf<float> dvs(units * g.U * g.V * unit_k, 0.f);
  Buf<float> dR(nthreads * g.C * g.Rnp, 0.f), dlc(content.has_value() ? nthreads * g.B * g.C * g.V : 0, 0.f);
  const u16* RVd = reinterpret_cast<const u16*>(RV.data_ptr<at::BFloat16>());
  const u16* RTVd = reinterpret_cast<const u16*>(RTV.data_ptr<at::BFloat16>());
  const u16* Td = reinterpret_cast<const u16*>(T.data_ptr<at::BFloat16>());
  const u16* lcTd = lcT.defined() ? reinterpret_cast<const u16*>(lcT.data_ptr<at::BFloat16>()) : nullptr;
  const Blocks qbl{g, g.C}, gybl{g, g.V};
  auto qb = to_blocks(g, q, g.C), gyb = to_blocks(g, gy, g.V), gqb = torch::empty({qbl.size()}, v.options());
  const u16* qbd = reinterpret_cast<const u16*>(qb.data_ptr<at::BFloat16>());
  const u16* gybd = reinterpret_cast<const u16*>(gyb.data_ptr<at::BFloat16>());
  u16* gqbd = reinterpret_cast<u16*>(gqb.data_ptr<at::BFloat16>());
  const int64_t MP = g.M / 2;
  parallel_units(units, [&](int64_t begin, int64_t end) {
    const int tid = at::get_thread_num();
    Block blk(g);
    // per block: the band of each |u| VNNI over m [M / 2, Kb, 2] (B of gy^T band); gy^T [V, M] (A of the value
    // gradients), gy [M, Vp] (A of the logit gradients and gy lambda^c^T) and VNNI over m [M / 2, V, 2] (B of
    // Q^T gy); Q^T [C, M] (A of dR and dlambda^c); the logit gradients over the band [M, Kb] in float32 and their
    // segments dL [M, Rnp] bfloat16 (A of dq) and VNNI over m [M / 2, Rnp, 2] (B of dR); dq [M, C]
    Buf<u16> gym(g.M * g.Vp, 0), gyV(content.has_value() ? g.M * g.V : 0);
    Buf<u16> dL(g.M * g.Rnp, 0), dLV(g.M * g.Rnp), dq16(g.M * g.C);
    Buf<float> dLb(g.M * g.Kb), dq(g.M * g.C);
    float* dRt = dR.data() + tid * g.C * g.Rnp;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t chunk = i % chunks, sx = i / chunks % g.NS, b = i / (chunks * g.NS);
      float* dv = dvs.data() + i * g.U * g.V * unit_k;
      const int64_t rb0 = chunk * per_chunk, rb1 = std::min(g.NRB, rb0 + per_chunk), unit_y = g.s * g.R * rb0;
      for (int64_t rb = rb0; rb < rb1; ++rb) {
        const int64_t ya = g.s * g.R * rb;
        const auto [y0, y1] = g.rows(rb);
        const int64_t k0 = y0 * g.Wb, kn = (y1 - y0) * g.Wb;
        const int64_t blk_i = (b * g.NRB + rb) * g.NS + sx;  // (to_blocks' order)
        blk.queries(qbd, blk_i, qbl.ld());
        blk.logits(RVd, true);  // (blk.Lb VNNI over m: [U, M / 2, Kb, 2])
        const u16 *gyT = gybd + gybl.at(blk_i), *QT = blk.QT;  // [V, M], [C, M], rows gybl.ld(), qbl.ld() apart
        transpose16(gyT, gybl.ld(), g.V, g.M, gym.data(), g.Vp);
        std::fill(dq.begin(), dq.end(), 0.f);
        for (int64_t u = 0; u < g.U; ++u) {
          const u16* LbV = blk.Lb.data() + u * g.M * g.Kb;
          // value gradients: dv^T[j, k] += sum_m gy^T[j, m] band[m, k]
          float* dvu = dv + u * g.V * unit_k + (ya - unit_y + y0) * g.Wb;
          mm(g.V, kn, g.M, gyT, gybl.ld(), LbV + k0 * 2, g.Kb, dvu, unit_k, true);
          // logit gradients over the band: dLb[m, k] = sum_j gy[m, j] v[k, j]
          const u16* strip = Td + ((b * g.U + u) * g.NS + sx) * g.Vp * g.Kt;
          mm(g.M, kn, g.Vp, gym.data(), g.Vp, strip + (ya + y0) * g.Wb * 2, g.Kt, dLb.data() + k0, g.Kb, false);
          // their segments, rounded: dL[m, (u, ky, kx)] (0 for the rows past the image)
          for (int64_t m = 0; m < g.M; ++m) {
            const int64_t r = m / (g.H * g.nq), qx = m % g.nq;
            u16* dst = dL.data() + m * g.Rnp + u * g.KH * g.KW;
              // scope rows [ky0, ky1) are the band's rows [y0, y1)
            const int64_t ky0 = std::min(g.KH, std::max<int64_t>(0, y0 - g.s * r));
            const int64_t ky1 = std::max(ky0, std::min(g.KH, y1 - g.s * r));
            std::memset(dst, 0, ky0 * g.KW * sizeof(u16));
            segments_to_bf16(dLb.data() + m * g.Kb + (g.s * r + ky0) * g.Wb + g.s * qx, g.Wb, dst + ky0 * g.KW, g.KW,
                             g.KW, ky1 - ky0);
            std::memset(dst + ky1 * g.KW, 0, (g.KH - ky1) * g.KW * sizeof(u16));
          }
        }
        // dq = dL R^T (+ gy lambda^c^T), dR += Q^T dL, dlambda^c += Q^T gy
        mm(g.M, g.C, g.Rnp, dL.data(), g.Rnp, RTVd, g.C, dq.data(), g.C, false);
        if (lcTd != nullptr) mm(g.M, g.C, g.Vp, gym.data(), g.Vp, lcTd + b * g.Vp * g.C, g.C, dq.data(), g.C, true);
        for (int64_t p = 0; p < MP; ++p)
          interleave(dL.data() + 2 * p * g.Rnp, dL.data() + (2 * p + 1) * g.Rnp, dLV.data() + p * g.Rnp * 2, g.Rnp);
        mm(g.C, g.Rnp, g.M, QT, qbl.ld(), dLV.data(), g.Rnp, dRt, g.Rnp, true);
        if (lcTd != nullptr) {
          for (int64_t p = 0; p < MP; ++p)
            interleave(gym.data() + 2 * p * g.Vp, gym.data() + (2 * p + 1) * g.Vp, gyV.data() + p * g.V * 2, g.V);
          mm(g.C, g.V, g.M, QT, qbl.ld(), gyV.data(), g.V, dlc.data() + (tid * g.B + b) * g.C * g.V, g.V, true);
        }
        segments_to_bf16(dq.data(), g.C, dq16.data(), g.C, g.C, g.M);
        transpose16(dq16.data(), g.C, g.M, g.C, gqbd + qbl.at(blk_i), qbl.ld());
      }
    }
  });
  from_blocks(g, gqbd, g.C, reinterpret_cast<u16*>(gq.data_ptr<at::BFloat16>()));
  // gv[b, u V + j, y, x] = the sum over the units of image b of their accumulators at (y + y_lo, x + x_lo)
  u16* gvd = reinterpret_cast<u16*>(gv.data_ptr<at::BFloat16>());
  at::parallel_for(0, g.B * g.CV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(g.Hh * g.Ww);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / g.CV, u = i % g.CV / g.V, j = i % g.V;
      float* plane = sum.data();
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t sx = 0; sx < g.NS; ++sx)
        for (int64_t chunk = 0; chunk < chunks; ++chunk) {
          const int64_t unit = (b * g.NS + sx) * chunks + chunk, unit_y = g.s * g.R * chunk * per_chunk;
          const float* acc = dvs.data() + (unit * g.U + u) * g.V * unit_k + j * unit_k;
          const int64_t x0 = sx * g.s * g.nq - g.x_lo, c0 = std::max<int64_t>(0, -x0);
          const int64_t c1 = std::min(g.Wb, g.Ww - x0);
          for (int64_t p = 0; p < unit_rows; ++p) {
            const int64_t yy = unit_y + p - g.y_lo;
            if (yy < 0 || yy >= g.Hh) continue;
            float* dst = plane + yy * g.Ww;  // image row yy: column x0 + c
            const float* src = acc + p * g.Wb;
            for (int64_t c = c0; c < c1; ++c) dst[x0 + c] += src[c];
          }
        }
      segments_to_bf16(plane, g.Hh * g.Ww, gvd + i * g.Hh * g.Ww, 0, g.Hh * g.Ww, 1);
    }
  });
  // the table's and the content lambda's: the threads' parts summed in float32, rounded once
  std::vector<float> gt(g.C * g.Rn, 0.f), gc(dlc.size() / std::max(nthreads, 1), 0.f);
  for (int t = 0; t < nthreads; ++t)
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t n = 0; n < g.Rn; ++n) gt[c * g.Rn + n] += dR[(t * g.C + c) * g.Rnp + n];
  segments_to_bf16(gt.data(), 0, reinterpret_cast<u16*>(gtable.data_ptr<at::BFloat16>()), 0, g.C * g.Rn, 1);
  if (content.has_value()) {
    for (int t = 0; t < nthreads; ++t)
      for (size_t e = 0; e < gc.size(); ++e) gc[e] += dlc[t * gc.size() + e];
    segments_to_bf16(gc.data(), 0, reinterpret_cast<u16*>(gcontent.data_ptr<at::BFloat16>()), 0, gc.size(), 1);
  }
  return {gq, gv, gtable, gcontent};
}
#endif
