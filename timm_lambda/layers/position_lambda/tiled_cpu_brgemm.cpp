// The tiled position lambdas in bfloat16 by oneDNN's BRGEMM micro-kernel (torch's at::native::cpublas::brgemm):
// AMX tiles where the CPU has AMX-BF16 (and oneDNN may use it), else oneDNN's AVX-512 BF16 micro-kernel; compiled
// where the compiler targets AVX-512 BF16 (tiled_cpu.h says what the kernels compute).
//
// Every product is one BRGEMM call of a block of queries: R query rows x nq queries along a row, all heads, M = R h
// nq rows (r, head, qx). A query's scope row is a contiguous run of K_w columns of a value row, and the runs of the
// block's queries lie in one band of Wb = s (nq - 1) + K_w columns (s = step): the values are laid out once per call
// in column strips, strip i holding the Wb columns from s nq i of every padded value row, so that the block's KR = s
// (R - 1) + K_h value rows are one contiguous operand of K = KR Wb rows. Each query's logits then sit in its own
// K_w-column segment of each row of the band (zero elsewhere), and the aggregation y = L v is one GEMM of depth KR Wb
// (a K_w / Wb share of it nonzero: 23 / 30 at stride 1, 25 / 32 at the patched stride 2). The backward is four more:
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

// dst[i] = bfloat16(src[i]) (round to nearest even), i < n
inline void to_bf16(const float* src, u16* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  if (i < n) {
    const __mmask16 k = __mmask16((1u << (n - i)) - 1);
    _mm256_mask_storeu_epi16(dst + i, k, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, src + i)));
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
    // the band as close to 32 columns (one AMX tile's depth) as the scope allows: K_w / Wb of the aggregation is work
    nq = std::max<int64_t>(2, std::min<int64_t>(16, ((32 - KW) / s + 1) / 2 * 2));
    nq = std::min(nq, round_up(Wo, 2));
    R = std::max<int64_t>(1, std::min(Ho, 128 / (H * nq)));
    if (block.size() == 2 && block[0] > 0) nq = round_up(block[0], 2);
    if (block.size() == 2 && block[1] > 0) R = block[1];
    M = R * H * nq;  // even: nq is
    Wb = round_up(s * (nq - 1) + KW, 2);
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

// v [B, CV, H, W] bfloat16 (any strides) -> [B, H, W, CV] contiguous, on all threads
torch::Tensor channels_last(const torch::Tensor& v) {
  const int64_t B = v.size(0), CV = v.size(1), H = v.size(2), W = v.size(3), blocks = (W + 63) / 64;
  const int64_t sb = v.stride(0), sc = v.stride(1), sy = v.stride(2), sx = v.stride(3);
  auto out = torch::empty({B, H, W, CV}, v.options());
  const u16* src = reinterpret_cast<const u16*>(v.data_ptr<at::BFloat16>());
  u16* dst = reinterpret_cast<u16*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (H * blocks), y = i / blocks % H, x0 = i % blocks * 64, x1 = std::min(W, x0 + 64);
      u16* row = dst + ((b * H + y) * W) * CV;
      for (int64_t c = 0; c < CV; ++c) {
        const u16* s = src + b * sb + c * sc + y * sy;
        for (int64_t x = x0; x < x1; ++x) row[x * CV + c] = s[x * sx];
      }
    }
  });
  return out;
}

// x [rows, cols] bfloat16 (a matrix of any strides) as a B operand VNNI over its rows: [ceil(rows / 2), cols, 2],
// rows past x's zero (rows_p: rows rounded up to even); on the calling thread (tables and content lambdas: small)
torch::Tensor vnni_rows(const torch::Tensor& x, int64_t rows_p) {
  auto t = torch::zeros({rows_p, x.size(1)}, x.options());
  t.narrow(0, 0, x.size(0)).copy_(x);
  return t.view({rows_p / 2, 2, x.size(1)}).transpose(1, 2).contiguous();
}

// The per-block operands a thread reuses: the queries [M, Cp] (A of the logits and the content), the logits
// [M, Rnp] in float32, the band of each |u| [U, M, Kb] bfloat16 (zero outside each query's segments), the block's
// output [M, V] in float32
struct Block {
  const Geo& g;
  std::vector<u16> Q, Lb;
  std::vector<float> L;
  explicit Block(const Geo& geo)
      : g(geo), Q(g.M * g.Cp, 0), Lb(g.U * g.M * g.Kb, 0), L(g.M * g.Rnp) {}
  // Q[m, c] = q[b, h, c, oy0 + r, ox0 + qx] (m = (r H + h) nq + qx; 0 past the map)
  void queries(const u16* q, int64_t b, int64_t oy0, int64_t ox0) {
    const int64_t P = g.Ho * g.Wo, nqv = std::min(g.nq, g.Wo - ox0);
    for (int64_t r = 0; r < g.R; ++r) {
      const bool in = oy0 + r < g.Ho;
      for (int64_t h = 0; h < g.H; ++h) {
        u16* dst = Q.data() + (r * g.H + h) * g.nq * g.Cp;
        if (!in) { std::memset(dst, 0, g.nq * g.Cp * sizeof(u16)); continue; }
        const u16* src = q + ((b * g.H + h) * g.C) * P + (oy0 + r) * g.Wo + ox0;
        for (int64_t c = 0; c < g.C; ++c)
          for (int64_t qx = 0; qx < nqv; ++qx) dst[qx * g.Cp + c] = src[c * P + qx];
        for (int64_t qx = nqv; qx < g.nq; ++qx) std::memset(dst + qx * g.Cp, 0, g.C * sizeof(u16));
      }
    }
  }
  // the logits L = Q R and each |u|'s band: Lb[u, m, (s r + ky) Wb + s qx + kx] = bfloat16(L[m, (u, ky, kx)])
  void logits(const u16* RV) {
    mm(g.M, g.Rnp, g.Cp, Q.data(), g.Cp, RV, g.Rnp, L.data(), g.Rnp, false);
    for (int64_t u = 0; u < g.U; ++u)
      for (int64_t m = 0; m < g.M; ++m) {
        const int64_t r = m / (g.H * g.nq), qx = m % g.nq;
        u16* dst = Lb.data() + (u * g.M + m) * g.Kb + g.s * r * g.Wb + g.s * qx;
        const float* src = L.data() + m * g.Rnp + u * g.KH * g.KW;
        for (int64_t ky = 0; ky < g.KH; ++ky) to_bf16(src + ky * g.KW, dst + ky * g.Wb, g.KW);
      }
  }
};

void check_inputs(const char* name, const std::vector<const torch::Tensor*>& ts, const torch::Tensor& q,
                  const torch::Tensor& v, const torch::Tensor& table, int64_t step,
                  const std::vector<int64_t>& block) {
  TORCH_CHECK(block.empty() || (block.size() == 2 && block[0] >= 0 && block[1] >= 0 && block[0] <= 256 &&
                                block[1] <= 256),
              name, ": block is [] or [queries, rows] (0: the default), each at most 256, got ", block);
  for (const auto* t : ts)
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->device().is_cpu(), name, ": bfloat16 CPU tensors only");
  TORCH_CHECK(q.dim() == 5 && v.dim() == 4 && table.dim() == 4, name, ": q [B, h, c, Ho, Wo], v [B, u V, H, W] and ",
              "table [c, u, K_h, K_w], got ", q.sizes(), ", ", v.sizes(), ", ", table.sizes());
  TORCH_CHECK(step == 1 || step == 2, name, ": step 1 or 2, got ", step);
  TORCH_CHECK(table.size(1) > 0 && v.size(1) % table.size(1) == 0 && v.size(0) == q.size(0) &&
                  table.size(0) == q.size(2),
              name, ": q ", q.sizes(), ", v ", v.sizes(), " and table ", table.sizes(), " do not match");
  TORCH_CHECK(q.size(3) == (v.size(2) + step - 1) / step && q.size(4) == (v.size(3) + step - 1) / step, name,
              ": q's map ", q.sizes(), " is not v's ", v.sizes(), " at step ", step);
}

// the content lambda [B, c, V] bfloat16 as B operands: [B, Cp / 2, V, 2] (VNNI over c: q lambda^c) and its
// transpose [B, Vp / 2, c, 2] (VNNI over V: gy lambda^c^T)
std::pair<torch::Tensor, torch::Tensor> content_operands(const std::optional<torch::Tensor>& content, const Geo& g,
                                                         bool transposed) {
  if (!content.has_value()) return {};
  const auto& lc = *content;
  TORCH_CHECK(lc.scalar_type() == torch::kBFloat16 && lc.dim() == 3 && lc.size(0) == g.B && lc.size(1) == g.C &&
                  lc.size(2) == g.V,
              "tiled_position_lambdas: content ", lc.sizes(), " is not bfloat16 [", g.B, ", ", g.C, ", ", g.V, "]");
  std::vector<torch::Tensor> a, t;
  for (int64_t b = 0; b < g.B; ++b) {
    a.push_back(vnni_rows(lc[b], g.Cp));
    if (transposed) t.push_back(vnni_rows(lc[b].t(), g.Vp));
  }
  return {torch::stack(a), transposed ? torch::stack(t) : torch::Tensor()};
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
  check_inputs("tiled_forward_brgemm", {&q, &v, &table}, q, v, table, step, block);
  q = q.contiguous();
  const Geo g(q, v, table, step, block);
  auto y = torch::empty({g.B, g.H * g.V, g.Ho, g.Wo}, v.options());
  if (y.numel() == 0) return y;
  auto RV = vnni_rows(table.reshape({g.C, g.Rn}), g.Cp);  // [Cp / 2, Rn, 2]
  RV = torch::constant_pad_nd(RV, {0, 0, 0, g.Rnp - g.Rn}).contiguous();
  const auto lc = content_operands(content, g, false).first;
  auto F = forward_strips(g, channels_last(v));
  const u16* qd = reinterpret_cast<const u16*>(q.data_ptr<at::BFloat16>());
  const u16* RVd = reinterpret_cast<const u16*>(RV.data_ptr<at::BFloat16>());
  const u16* Fd = reinterpret_cast<const u16*>(F.data_ptr<at::BFloat16>());
  const u16* lcd = lc.defined() ? reinterpret_cast<const u16*>(lc.data_ptr<at::BFloat16>()) : nullptr;
  u16* yd = reinterpret_cast<u16*>(y.data_ptr<at::BFloat16>());
  const int64_t P = g.Ho * g.Wo;
  parallel_units(g.B * g.NRB * g.NS, [&](int64_t begin, int64_t end) {
    Block blk(g);
    std::vector<float> out(g.M * g.V);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t sx = i % g.NS, rb = i / g.NS % g.NRB, b = i / (g.NS * g.NRB);
      const int64_t oy0 = rb * g.R, ox0 = sx * g.nq, ya = g.s * oy0;
      blk.queries(qd, b, oy0, ox0);
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
      const int64_t nqv = std::min(g.nq, g.Wo - ox0);
      for (int64_t r = 0; r < g.R && oy0 + r < g.Ho; ++r)
        for (int64_t h = 0; h < g.H; ++h)
          for (int64_t j = 0; j < g.V; ++j) {
            u16* dst = yd + (b * g.H * g.V + h * g.V + j) * P + (oy0 + r) * g.Wo + ox0;
            const float* src = out.data() + ((r * g.H + h) * g.nq) * g.V + j;
            for (int64_t qx = 0; qx < nqv; ++qx) dst[qx] = at::BFloat16(src[qx * g.V]).x;
          }
    }
  });
  return y;
}

// gradients of tiled_forward_brgemm (gy, q, v, table, content bfloat16) in float32, laid out as the inputs
// (gcontent empty without a content lambda): per block the logits again, then per |u| the value gradients
// gy^T band_u (into the strip's accumulators) and the logit gradients gy strip_u^T over the band, whose segments,
// rounded to bfloat16, give dq = dL R^T (+ gy lambda^c^T) and dR += Q^T dL (and dlambda^c += Q^T gy)
std::vector<torch::Tensor> tiled_backward_brgemm(torch::Tensor gy, torch::Tensor q, torch::Tensor v,
                                                 torch::Tensor table, std::optional<torch::Tensor> content,
                                                 int64_t step, std::vector<int64_t> block) {
  check_inputs("tiled_backward_brgemm", {&gy, &q, &v, &table}, q, v, table, step, block);
  gy = gy.contiguous(); q = q.contiguous();
  const Geo g(q, v, table, step, block);
  TORCH_CHECK(gy.dim() == 4 && gy.size(0) == g.B && gy.size(1) == g.H * g.V && gy.size(2) == g.Ho &&
                  gy.size(3) == g.Wo,
              "tiled_backward_brgemm: gy ", gy.sizes(), " is not the output's [", g.B, ", ", g.H * g.V, ", ", g.Ho,
              ", ", g.Wo, "]");
  const auto fopts = v.options().dtype(torch::kFloat);
  auto gq = torch::zeros({g.B, g.H, g.C, g.Ho, g.Wo}, fopts);
  auto gv = torch::zeros({g.B, g.CV, g.Hh, g.Ww}, fopts);
  auto gtable = torch::zeros({g.C, g.U, g.KH, g.KW}, fopts);
  auto gcontent = torch::zeros(content.has_value() ? std::vector<int64_t>{g.B, g.C, g.V} : std::vector<int64_t>{0},
                               fopts);
  if (gy.numel() == 0 || v.numel() == 0) return {gq, gv, gtable, gcontent};
  auto R2 = table.reshape({g.C, g.Rn});
  auto RV = torch::constant_pad_nd(vnni_rows(R2, g.Cp), {0, 0, 0, g.Rnp - g.Rn}).contiguous();  // [Cp/2, Rnp, 2]
  auto RTV = vnni_rows(torch::constant_pad_nd(R2.t(), {0, 0, 0, g.Rnp - g.Rn}), g.Rnp);  // [Rnp / 2, C, 2]
  const auto [lc, lcT] = content_operands(content, g, true);
  auto T = backward_strips(g, v.contiguous());
  // work units: (image, strip, chunk of row blocks), each with its own value-gradient accumulators over the padded
  // rows its blocks reach, [U, V, rows Wb] float32 (transposed strips: C of gy^T band); enough units for the threads
  const int nthreads = at::get_num_threads();
  const int64_t chunks = std::min(g.NRB, std::max<int64_t>(1, (2 * nthreads + g.B * g.NS - 1) / (g.B * g.NS)));
  const int64_t per_chunk = (g.NRB + chunks - 1) / chunks, unit_rows = g.s * (per_chunk * g.R - 1) + g.KH;
  const int64_t units = g.B * g.NS * chunks, unit_k = unit_rows * g.Wb;
  std::vector<float> dvs(units * g.U * g.V * unit_k, 0.f);
  std::vector<float> dR(nthreads * g.C * g.Rnp, 0.f), dlc(content.has_value() ? nthreads * g.B * g.C * g.V : 0, 0.f);
  const u16* qd = reinterpret_cast<const u16*>(q.data_ptr<at::BFloat16>());
  const u16* gyd = reinterpret_cast<const u16*>(gy.data_ptr<at::BFloat16>());
  const u16* RVd = reinterpret_cast<const u16*>(RV.data_ptr<at::BFloat16>());
  const u16* RTVd = reinterpret_cast<const u16*>(RTV.data_ptr<at::BFloat16>());
  const u16* Td = reinterpret_cast<const u16*>(T.data_ptr<at::BFloat16>());
  const u16* lcTd = lcT.defined() ? reinterpret_cast<const u16*>(lcT.data_ptr<at::BFloat16>()) : nullptr;
  float* gqd = gq.data_ptr<float>();
  const int64_t P = g.Ho * g.Wo, MP = g.M / 2;
  parallel_units(units, [&](int64_t begin, int64_t end) {
    const int tid = at::get_thread_num();
    Block blk(g);
    // per block: the band of each |u| VNNI over m [M / 2, Kb, 2] (B of gy^T band); gy^T [V, M] (A of the value
    // gradients), gy [M, Vp] (A of the logit gradients and gy lambda^c^T) and VNNI over m [M / 2, V, 2] (B of
    // Q^T gy); Q^T [C, M] (A of dR and dlambda^c); the logit gradients over the band [M, Kb] in float32 and their
    // segments dL [M, Rnp] bfloat16 (A of dq) and VNNI over m [M / 2, Rnp, 2] (B of dR); dq [M, C]
    std::vector<u16> LbV(g.M * g.Kb), gyT(g.V * g.M), gym(g.M * g.Vp, 0), gyV(content.has_value() ? g.M * g.V : 0);
    std::vector<u16> QT(g.C * g.M), dL(g.M * g.Rnp, 0), dLV(g.M * g.Rnp);
    std::vector<float> dLb(g.M * g.Kb), dq(g.M * g.C);
    float* dRt = dR.data() + tid * g.C * g.Rnp;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t chunk = i % chunks, sx = i / chunks % g.NS, b = i / (chunks * g.NS);
      float* dv = dvs.data() + i * g.U * g.V * unit_k;
      const int64_t rb0 = chunk * per_chunk, rb1 = std::min(g.NRB, rb0 + per_chunk), unit_y = g.s * g.R * rb0;
      const int64_t ox0 = sx * g.nq, nqv = std::min(g.nq, g.Wo - ox0);
      for (int64_t rb = rb0; rb < rb1; ++rb) {
        const int64_t oy0 = rb * g.R, ya = g.s * oy0;
        const auto [y0, y1] = g.rows(rb);
        const int64_t k0 = y0 * g.Wb, kn = (y1 - y0) * g.Wb;
        blk.queries(qd, b, oy0, ox0);
        blk.logits(RVd);
        // gy^T [V, M] and gy [M, Vp]; Q^T [C, M]
        for (int64_t r = 0; r < g.R; ++r)
          for (int64_t h = 0; h < g.H; ++h) {
            const int64_t m0 = (r * g.H + h) * g.nq;
            const bool in = oy0 + r < g.Ho;
            for (int64_t j = 0; j < g.V; ++j) {
              u16* dst = gyT.data() + j * g.M + m0;
              if (in) std::memcpy(dst, gyd + (b * g.H * g.V + h * g.V + j) * P + (oy0 + r) * g.Wo + ox0,
                                  nqv * sizeof(u16));
              std::fill(dst + (in ? nqv : 0), dst + g.nq, u16(0));
            }
            for (int64_t c = 0; c < g.C; ++c)
              for (int64_t qx = 0; qx < g.nq; ++qx) QT[c * g.M + m0 + qx] = blk.Q[(m0 + qx) * g.Cp + c];
          }
        for (int64_t j = 0; j < g.V; ++j)
          for (int64_t m = 0; m < g.M; ++m) gym[m * g.Vp + j] = gyT[j * g.M + m];
        std::fill(dq.begin(), dq.end(), 0.f);
        for (int64_t u = 0; u < g.U; ++u) {
          const u16* Lb = blk.Lb.data() + u * g.M * g.Kb;
          for (int64_t p = 0; p < MP; ++p)
            interleave(Lb + 2 * p * g.Kb + k0, Lb + (2 * p + 1) * g.Kb + k0, LbV.data() + (p * g.Kb + k0) * 2, kn);
          // value gradients: dv^T[j, k] += sum_m gy^T[j, m] band[m, k]
          mm(g.V, kn, g.M, gyT.data(), g.M, LbV.data() + k0 * 2, g.Kb, dv + u * g.V * unit_k + (ya - unit_y + y0) * g.Wb,
             unit_k, true);
          // logit gradients over the band: dLb[m, k] = sum_j gy[m, j] v[k, j]
          const u16* strip = Td + ((b * g.U + u) * g.NS + sx) * g.Vp * g.Kt;
          mm(g.M, kn, g.Vp, gym.data(), g.Vp, strip + (ya + y0) * g.Wb * 2, g.Kt, dLb.data() + k0, g.Kb, false);
          // their segments, rounded: dL[m, (u, ky, kx)] (0 for the rows past the image)
          for (int64_t m = 0; m < g.M; ++m) {
            const int64_t r = m / (g.H * g.nq), qx = m % g.nq;
            u16* dst = dL.data() + m * g.Rnp + u * g.KH * g.KW;
            for (int64_t ky = 0; ky < g.KH; ++ky) {
              const int64_t row = g.s * r + ky;
              if (row >= y0 && row < y1)
                to_bf16(dLb.data() + m * g.Kb + row * g.Wb + g.s * qx, dst + ky * g.KW, g.KW);
              else
                std::memset(dst + ky * g.KW, 0, g.KW * sizeof(u16));
            }
          }
        }
        // dq = dL R^T (+ gy lambda^c^T), dR += Q^T dL, dlambda^c += Q^T gy
        mm(g.M, g.C, g.Rnp, dL.data(), g.Rnp, RTVd, g.C, dq.data(), g.C, false);
        if (lcTd != nullptr) mm(g.M, g.C, g.Vp, gym.data(), g.Vp, lcTd + b * g.Vp * g.C, g.C, dq.data(), g.C, true);
        for (int64_t p = 0; p < MP; ++p)
          interleave(dL.data() + 2 * p * g.Rnp, dL.data() + (2 * p + 1) * g.Rnp, dLV.data() + p * g.Rnp * 2, g.Rnp);
        mm(g.C, g.Rnp, g.M, QT.data(), g.M, dLV.data(), g.Rnp, dRt, g.Rnp, true);
        if (lcTd != nullptr) {
          for (int64_t p = 0; p < MP; ++p)
            interleave(gym.data() + 2 * p * g.Vp, gym.data() + (2 * p + 1) * g.Vp, gyV.data() + p * g.V * 2, g.V);
          mm(g.C, g.V, g.M, QT.data(), g.M, gyV.data(), g.V, dlc.data() + (tid * g.B + b) * g.C * g.V, g.V, true);
        }
        for (int64_t r = 0; r < g.R && oy0 + r < g.Ho; ++r)
          for (int64_t h = 0; h < g.H; ++h)
            for (int64_t c = 0; c < g.C; ++c) {
              float* dst = gqd + ((b * g.H + h) * g.C + c) * P + (oy0 + r) * g.Wo + ox0;
              const float* src = dq.data() + ((r * g.H + h) * g.nq) * g.C + c;
              for (int64_t qx = 0; qx < nqv; ++qx) dst[qx] = src[qx * g.C];
            }
      }
    }
  });
  // gv[b, u V + j, y, x] = the sum over the units of image b of their accumulators at (y + y_lo, x + x_lo)
  float* gvd = gv.data_ptr<float>();
  at::parallel_for(0, g.B * g.CV, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / g.CV, u = i % g.CV / g.V, j = i % g.V;
      float* plane = gvd + i * g.Hh * g.Ww;
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
    }
  });
  float* gt = gtable.data_ptr<float>();
  for (int t = 0; t < nthreads; ++t)
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t n = 0; n < g.Rn; ++n) gt[c * g.Rn + n] += dR[(t * g.C + c) * g.Rnp + n];
  if (content.has_value()) {
    float* gc = gcontent.data_ptr<float>();
    for (int t = 0; t < nthreads; ++t)
      for (int64_t e = 0; e < g.B * g.C * g.V; ++e) gc[e] += dlc[t * g.B * g.C * g.V + e];
  }
  return {gq, gv, gtable, gcontent};
}
#endif
