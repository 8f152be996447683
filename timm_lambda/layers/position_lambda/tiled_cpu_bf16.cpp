// The tiled position lambdas' CPU kernels in bfloat16, where the compiler targets AVX-512 BF16 (tiled_cpu.h says
// what they compute).
#include "tiled_cpu.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>

// bfloat16 inputs (CPU autocast) on AVX-512 BF16, computed as a bfloat16 matmul and its backward compute: products
// of bfloat16 operands by VDPBF16PS (two multiply-adds per float32 lane, over a pair of the reduced dimension: scope
// columns, channels, heads or queries), sums in float32, each result rounded once. Forward: the logits q R, rounded
// to bfloat16, then y = L v over pairs of scope columns (kx, kx + 1). The logits' rows are KWs = KW + 1 rounded up
// to even long, the columns past KW zero (zero table columns), so a pair that passes the scope's last column adds 0;
// the value pairs are 0 past the image, so a pair that passes the image's last column adds 0 too. Backward: the logit
// gradients gy . v over channel pairs, the value gradients L^T gy over head pairs (the logits rounded as in the
// forward), and from the logit gradients rounded to bfloat16 the query and table gradients over scope-column and
// query pairs; an odd count's last pair is padded with zero.
namespace {
using namespace tiled_cpu;

inline float bf16_to_float(uint16_t x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// v [B, CV, H, W] bfloat16 (any strides) -> pairs [B, H, W, CV] (uint32): at (y, x, c) the bfloat16 pair
// (v[c, y, x], v[c, y, x + 1]), low half first, the second 0 past the image; on all threads
torch::Tensor column_pairs(const torch::Tensor& v) {
  auto out = torch::empty({v.size(0), v.size(2), v.size(3), v.size(1)}, v.options().dtype(torch::kInt32));
  const int64_t sx = v.stride(3), W = v.size(3);
  channels_last_of<uint16_t>(v, reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()),
                             [sx, W](const uint16_t* s, int64_t x) {
                               return uint32_t(s[x * sx]) | (x + 1 < W ? uint32_t(s[(x + 1) * sx]) << 16 : 0u);
                             });
  return out;
}

// y[h * osh + j * osj] = sum_{u, ky, kx} L[h * ls + (u, ky, kx)] v[...] as aggregate_tile, over column pairs: Lb
// bfloat16 logits (rows KWs long), vp the value pairs (column_pairs; vo, rs in pairs), 16 channels a vector
template <int MB, int NV>
__attribute__((noinline)) void aggregate_tile_bf16(const uint16_t* __restrict Lb, int64_t ls,
                                                   const uint32_t* __restrict vp, int64_t vo, int64_t U,
                                                   const Scope& sc, int64_t KWs, int64_t rs, int64_t CV, int64_t V,
                                                   int64_t j0, const Content<float>& ct, float* __restrict out,
                                                   int64_t osj, int64_t osh) {
  vec_t<float> acc[MB][NV];  // not __m512: GCC 12 kept those in memory, one store per instruction
  for (int m = 0; m < MB; ++m) for (int i = 0; i < NV; ++i) acc[m][i] = vec_t<float>{};
  if (ct.lc != nullptr)
    for (int64_t c = 0; c < ct.C; ++c) {
      vec_t<float> vv[NV];
      for (int i = 0; i < NV; ++i) { vv[i] = loadv(ct.lc + c * V + j0 + i * 16); KEEP_IN_REGISTER(vv[i]); }
      for (int m = 0; m < MB; ++m) {
        const float l = ct.q[m * ct.qs + c];
        for (int i = 0; i < NV; ++i) acc[m][i] += l * vv[i];
      }
    }
  for (int64_t u = 0; u < U; ++u)
    for (int64_t ky = sc.y0; ky < sc.y1; ++ky)
      for (int64_t kx = sc.x0; kx < sc.x1; kx += 2) {
        const int64_t r = (u * sc.KH + ky) * KWs + kx;
        const uint32_t* vx = vp + (vo + ky * rs + kx * CV + u * V + j0);
        __m512bh vv[NV];
        for (int i = 0; i < NV; ++i) { vv[i] = (__m512bh)_mm512_loadu_si512(vx + i * 16); KEEP_IN_REGISTER(vv[i]); }
        for (int m = 0; m < MB; ++m) {
          uint32_t pair;
          std::memcpy(&pair, Lb + m * ls + r, sizeof(pair));
          const __m512bh l = (__m512bh)_mm512_set1_epi32(int32_t(pair));
          for (int i = 0; i < NV; ++i) acc[m][i] = (vec_t<float>)_mm512_dpbf16_ps((__m512)acc[m][i], l, vv[i]);
        }
      }
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < NV; ++i) {
      for (int e = 0; e < 16; ++e) out[m * osh + (j0 + i * 16 + e) * osj] = acc[m][i][e];
    }
}

void aggregate_bf16(const uint16_t* Lb, int64_t ls, const uint32_t* vp, int64_t vo, int64_t H, int64_t U,
                    const Scope& sc, int64_t KWs, int64_t rs, int64_t CV, int64_t V, const Content<float>& content,
                    float* out, int64_t osj, int64_t osh) {
  auto rows = [&](int64_t h) { return Content<float>{content.q + h * content.qs, content.qs, content.lc, content.C}; };
  for_tiles<16, 4>(
      H, V,
      [&](auto mb, auto nv, int64_t h, int64_t j) {
        aggregate_tile_bf16<decltype(mb)::value, decltype(nv)::value>(Lb + h * ls, ls, vp, vo, U, sc, KWs, rs, CV, V,
                                                                      j, rows(h), out + h * osh, osj, osh);
      },
      [&](auto mb, int64_t h, int64_t j) {
        const Content<float> ct = rows(h);
        for (int m = 0; m < decltype(mb)::value; ++m) {
          float acc = 0;
          if (ct.lc != nullptr)
            for (int64_t c = 0; c < ct.C; ++c) acc += ct.q[m * ct.qs + c] * ct.lc[c * V + j];
          for (int64_t u = 0; u < U; ++u)
            for (int64_t ky = sc.y0; ky < sc.y1; ++ky)
              for (int64_t kx = sc.x0; kx < sc.x1; kx += 2) {
                const uint16_t* l = Lb + (h + m) * ls + (u * sc.KH + ky) * KWs + kx;
                const uint32_t pair = vp[vo + ky * rs + kx * CV + u * V + j];
                acc += bf16_to_float(l[0]) * bf16_to_float(uint16_t(pair)) +
                       bf16_to_float(l[1]) * bf16_to_float(uint16_t(pair >> 16));
              }
          out[(h + m) * osh + j * osj] = acc;
        }
      });
}


// out[m * os + n] (+)= sum_k a[m * as + k * ak] . b[k * bs + n] for m < MB, n in [n0, n0 + 16 NV): each term a
// pair of bfloat16 products (uint32 pairs, one VDPBF16PS lane), float32 sums
template <int MB, int NV, bool ACC>
__attribute__((noinline)) void pair_gemm_tile(const uint32_t* __restrict a, int64_t as, int64_t ak,
                                              const uint32_t* __restrict b, int64_t bs, int64_t K, int64_t n0,
                                              float* __restrict out, int64_t os) {
  vec_t<float> acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < NV; ++i) acc[m][i] = ACC ? loadv(out + m * os + n0 + i * 16) : vec_t<float>{};
  for (int64_t k = 0; k < K; ++k) {
    __m512bh bv[NV];
    for (int i = 0; i < NV; ++i) {
      bv[i] = (__m512bh)_mm512_loadu_si512(b + k * bs + n0 + i * 16);
      KEEP_IN_REGISTER(bv[i]);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512bh l = (__m512bh)_mm512_set1_epi32(int32_t(a[m * as + k * ak]));
      for (int i = 0; i < NV; ++i) acc[m][i] = (vec_t<float>)_mm512_dpbf16_ps((__m512)acc[m][i], l, bv[i]);
    }
  }
  for (int m = 0; m < MB; ++m) for (int i = 0; i < NV; ++i) storev(out + m * os + n0 + i * 16, acc[m][i]);
}

// out [M, N] (+)= a [M, K] (strides as, ak) b [K, N] over bfloat16 pairs (pair_gemm_tile), N a multiple of 16
template <bool ACC>
void pair_gemm(const uint32_t* a, int64_t as, int64_t ak, const uint32_t* b, int64_t bs, int64_t M, int64_t K,
               int64_t N, float* out, int64_t os) {
  auto tile = [&](int64_t n, auto nv) {
    constexpr int NV = decltype(nv)::value;
    int64_t m = 0;
    if constexpr (NV == 1)  // 8 accumulator chains: VDPBF16PS's latency needs more in flight than 4
      for (; m + 8 <= M; m += 8) pair_gemm_tile<8, NV, ACC>(a + m * as, as, ak, b, bs, K, n, out + m * os, os);
    for (; m + 4 <= M; m += 4) pair_gemm_tile<4, NV, ACC>(a + m * as, as, ak, b, bs, K, n, out + m * os, os);
    for (; m < M; ++m) pair_gemm_tile<1, NV, ACC>(a + m * as, as, ak, b, bs, K, n, out + m * os, os);
  };
  int64_t n = 0;
  for (; n + 64 <= N; n += 64) tile(n, std::integral_constant<int, 4>());
  for (; n < N; n += 16) tile(n, std::integral_constant<int, 1>());
}

// The logits of a run over pairs of channels: the queries qp [h, Tt, Cq] (pairs (2 i, 2 i + 1)), the table's pairs
// R2 [Cq, Rp] (rows KWs long) -> L [h, Tt, Rp] float32 for the columns of scope rows [ky0, ky1), as Shape::run_logits
void run_logits_bf16(const Shape& s, const uint32_t* qp, int64_t Cq, int64_t nq, const uint32_t* R2, int64_t Rp,
                     int64_t ky0, int64_t ky1, float* L) {
  const auto [first, last] = s.columns(ky0, ky1);
  const int64_t n0 = first / 16 * 16, n1 = round_up(last, 16);
  if (n1 <= n0) return;
  for (int64_t h = 0; h < s.H; ++h)
    pair_gemm<false>(qp + h * s.Tt * Cq, Cq, 1, R2 + n0, Rp, nq, Cq, n1 - n0, L + h * s.Tt * Rp + n0, Rp);
}

// the queries of a run as channel pairs: qp[(h Tt + qx) Cq + i] = (q[b, h, 2 i, oy, ox0 + qx], q[.., 2 i + 1, ..])
void pack_query_pairs(const Shape& s, const uint16_t* q, int64_t b, int64_t oy, int64_t ox0, int64_t nq, uint32_t* qp,
                      int64_t Cq) {
  const int64_t P = s.plane();
  for (int64_t h = 0; h < s.H; ++h)
    for (int64_t i = 0; i < Cq; ++i) {
      const uint16_t* lo = q + ((b * s.H + h) * s.C + 2 * i) * P + oy * s.Wo + ox0;
      for (int64_t qx = 0; qx < nq; ++qx)
        qp[(h * s.Tt + qx) * Cq + i] = uint32_t(lo[qx]) | (2 * i + 1 < s.C ? uint32_t(lo[P + qx]) << 16 : 0u);
    }
}

// a bfloat16 table [c, u, K_h, K_w] as channel pairs [ceil(c / 2), Rp] (uint32), each scope row KWs long (zero
// columns past K_w, zero past Rn and past c)
torch::Tensor table_pairs(const torch::Tensor& table, int64_t KWs, int64_t Rp) {
  const int64_t C = table.size(0), U = table.size(1), KH = table.size(2), KW = table.size(3), Cq = (C + 1) / 2;
  auto t = torch::zeros({2 * Cq, Rp}, table.options());
  t.narrow(0, 0, C).narrow(1, 0, U * KH * KWs).view({C, U, KH, KWs}).narrow(3, 0, KW).copy_(table);
  // [2 Cq, Rp] -> [Cq, Rp, 2] -> uint32 pairs
  return t.view({Cq, 2, Rp}).transpose(1, 2).contiguous().view(torch::kInt32).view({Cq, Rp});
}

// The logit gradients of one scope row of one head, glt [KWq, 8] (lanes: a run's queries), rounded to bfloat16
// pairs: over columns ga[kxp * 8 + qx] = (glt[2 kxp][qx], glt[2 kxp + 1][qx]) (0 past K_w), for the query gradients;
// over queries gb[kx * gs + i] = (glt[kx][2 i], glt[kx][2 i + 1]) (0 past the run's nq), for the table gradient
void logit_grad_pairs(const float* glt, int64_t KW, int64_t nq, uint32_t* ga, uint32_t* gb, int64_t gs) {
  constexpr int Q = QVec<float>::lanes;
  const __mmask8 lanes = __mmask8((1u << nq) - 1);
  for (int64_t kx = 0; kx < KW; kx += 2) {
    const __m256 lo = _mm256_maskz_loadu_ps(lanes, glt + kx * Q);
    const __m256 hi = kx + 1 < KW ? _mm256_maskz_loadu_ps(lanes, glt + (kx + 1) * Q) : _mm256_setzero_ps();
    const __m128i l16 = (__m128i)_mm256_cvtneps_pbh(lo), h16 = (__m128i)_mm256_cvtneps_pbh(hi);
    _mm256_storeu_si256((__m256i*)(ga + kx / 2 * Q),
                        _mm256_or_si256(_mm256_cvtepu16_epi32(l16), _mm256_slli_epi32(_mm256_cvtepu16_epi32(h16), 16)));
    _mm_storeu_si128((__m128i*)(gb + kx * gs), l16);  // 8 bfloat16 of a row: its 4 query pairs
    if (kx + 1 < KW) _mm_storeu_si128((__m128i*)(gb + (kx + 1) * gs), h16);
  }
}

// a bfloat16 table [c, u, K_h, K_w] as pairs of scope columns for the query gradients: [u K_h, ceil(K_w / 2), Cp]
// (uint32: (R[c, u, ky, 2 i], R[c, u, ky, 2 i + 1]), 0 past K_w and past c)
torch::Tensor column_pair_table(const torch::Tensor& table, int64_t Cp) {
  const int64_t C = table.size(0), UK = table.size(1) * table.size(2), KW = table.size(3), KWp = (KW + 1) / 2;
  auto t = torch::zeros({UK, 2 * KWp, Cp}, table.options());
  t.narrow(1, 0, KW).narrow(2, 0, C).copy_(table.reshape({C, UK, KW}).permute({1, 2, 0}));
  return t.view({UK, KWp, 2, Cp}).transpose(2, 3).contiguous().view(torch::kInt32).view({UK, KWp, Cp});
}

// bfloat16 pairs (lo | hi << 16) of two float32 vectors, each rounded to nearest even
inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
  const __m512i l = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
  const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
  return _mm512_or_si512(l, _mm512_slli_epi32(h, 16));
}

// v [B, CV = U V, H, W] bfloat16 (any strides) as rows_by_phase, each value a pair of channels (u V + 2 i,
// u V + 2 i + 1) (0 past V): out[b, y, p, u Vp + i, k] = the pair at padded column k step + p, [B, Hp, step, U Vp, Wq]
// (uint32; Vp = ceil(V / 2)), on all threads
torch::Tensor rows_by_phase_pairs(const torch::Tensor& v, int64_t U, int64_t Hp, int64_t Wq, int64_t y0, int64_t x0,
                                  int64_t step) {
  const int64_t V = v.size(1) / U, Vp = (V + 1) / 2;
  const int64_t sb = v.stride(0), sc = v.stride(1), sy = v.stride(2), sx = v.stride(3);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  return rows_by_phase_of<uint32_t>(
      v.size(0), U * Vp, v.size(2), v.size(3), Hp, Wq, y0, x0, step, v.options().dtype(torch::kInt32),
      [&](int64_t b, int64_t c, int64_t y, int64_t x) {
        const int64_t j = c % Vp * 2;
        const uint16_t* lo = src + b * sb + (c / Vp * V + j) * sc + y * sy + x * sx;
        return uint32_t(lo[0]) | (j + 1 < V ? uint32_t(lo[sc]) << 16 : 0u);
      });
}

// logit_grad_tile over channel pairs: out[(h0 + m) KWq + kx0 + k][q] = sum_i gy[h0 + m][i][q] . v[i bs + off[k] + q]
// (each term a pair of channels, one VDPBF16PS lane), m < MB, k < KB, q < 8
template <int MB, int KB>
__attribute__((noinline)) void logit_grad_tile_bf16(const uint32_t* __restrict gy, int64_t Vp,
                                                    const uint32_t* __restrict v, int64_t bs, const int64_t* off,
                                                    float* __restrict out, int64_t KWq) {
  constexpr int Q = QVec<float>::lanes;
  qvec_t<float> acc[MB][KB];
  int64_t o[KB];
  for (int k = 0; k < KB; ++k) o[k] = off[k];
  for (int m = 0; m < MB; ++m) for (int k = 0; k < KB; ++k) acc[m][k] = qvec_t<float>{};
  for (int64_t i = 0; i < Vp; ++i) {
    __m256bh g[MB];
    for (int m = 0; m < MB; ++m) g[m] = (__m256bh)_mm256_loadu_si256((const __m256i*)(gy + (m * Vp + i) * Q));
    for (int k = 0; k < KB; ++k) {
      __m256bh w = (__m256bh)_mm256_loadu_si256((const __m256i*)(v + i * bs + o[k]));
      KEEP_IN_REGISTER(w);
      for (int m = 0; m < MB; ++m) acc[m][k] = (qvec_t<float>)_mm256_dpbf16_ps((__m256)acc[m][k], g[m], w);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int k = 0; k < KB; ++k) std::memcpy(out + (m * KWq + k) * Q, &acc[m][k], sizeof(acc[m][k]));
}

// run_logit_grads over channel pairs (gy [h, Vp, q] pairs, v the pair rows of rows_by_phase_pairs)
void run_logit_grads_bf16(const uint32_t* gy, int64_t H, int64_t Vp, const uint32_t* v, int64_t bs, int64_t ps,
                          int64_t step, int64_t KWq, float* glt) {
  constexpr int Q = QVec<float>::lanes, KB = QVec<float>::columns;
  for (int64_t kx0 = 0; kx0 < KWq; kx0 += KB) {
    int64_t off[KB];
    for (int k = 0; k < KB; ++k) off[k] = (kx0 + k) % step * ps + (kx0 + k) / step;
    int64_t h = 0;
    for (; h + 4 <= H; h += 4)
      logit_grad_tile_bf16<4, KB>(gy + h * Vp * Q, Vp, v, bs, off, glt + (h * KWq + kx0) * Q, KWq);
    for (; h < H; ++h) logit_grad_tile_bf16<1, KB>(gy + h * Vp * Q, Vp, v, bs, off, glt + (h * KWq + kx0) * Q, KWq);
  }
}

// scatter over head pairs: v[(u, ky, kx) position, j] += sum_p L[p * ls + (u, ky, kx)] . gy[p * V + j] (each a pair of
// heads (2 p, 2 p + 1), bfloat16), j in [j0, j0 + 16 NV), p < HP
template <int HP, int NV>
__attribute__((noinline)) void scatter_tile_bf16(const uint32_t* __restrict L, int64_t ls,
                                                 const uint32_t* __restrict gy, int64_t V, float* __restrict v,
                                                 int64_t U, const Scope& sc, int64_t rs, int64_t j0) {
  __m512bh g[HP][NV];
  for (int p = 0; p < HP; ++p)
    for (int i = 0; i < NV; ++i) {
      g[p][i] = (__m512bh)_mm512_loadu_si512(gy + p * V + j0 + i * 16);
      KEEP_IN_REGISTER(g[p][i]);
    }
  for (int64_t u = 0; u < U; ++u)
    for (int64_t ky = sc.y0; ky < sc.y1; ++ky)
      for (int64_t kx = sc.x0, r = (u * sc.KH + ky) * sc.KW + sc.x0; kx < sc.x1; ++kx, ++r) {
        float* dst = v + ky * rs + kx * U * V + u * V + j0;
        vec_t<float> acc[NV];
        for (int i = 0; i < NV; ++i) acc[i] = loadv(dst + i * 16);
        for (int p = 0; p < HP; ++p) {
          const __m512bh l = (__m512bh)_mm512_set1_epi32(int32_t(L[p * ls + r]));
          for (int i = 0; i < NV; ++i) acc[i] = (vec_t<float>)_mm512_dpbf16_ps((__m512)acc[i], l, g[p][i]);
        }
        for (int i = 0; i < NV; ++i) storev(dst + i * 16, acc[i]);
      }
}

void scatter_bf16(const uint32_t* L, int64_t ls, const uint32_t* gy, int64_t HP, int64_t V, float* v, int64_t U,
                  const Scope& sc, int64_t rs) {
  for_tiles<16, 2>(
      HP, V,
      [&](auto mp, auto nv, int64_t p, int64_t j) {
        scatter_tile_bf16<decltype(mp)::value, decltype(nv)::value>(L + p * ls, ls, gy + p * V, V, v, U, sc, rs, j);
      },
      [&](auto mp, int64_t p, int64_t j) {
        for (int64_t u = 0; u < U; ++u)
          for (int64_t ky = sc.y0; ky < sc.y1; ++ky)
            for (int64_t kx = sc.x0; kx < sc.x1; ++kx) {
              float acc = 0;
              for (int m = 0; m < decltype(mp)::value; ++m) {
                const uint32_t l = L[(p + m) * ls + (u * sc.KH + ky) * sc.KW + kx], g = gy[(p + m) * V + j];
                acc += bf16_to_float(uint16_t(l)) * bf16_to_float(uint16_t(g)) +
                       bf16_to_float(uint16_t(l >> 16)) * bf16_to_float(uint16_t(g >> 16));
              }
              v[ky * rs + kx * U * V + u * V + j] += acc;
            }
      });
}

}  // namespace

// q [B, h, c, Ho, Wo], v [B, u V, H, W], table [c, u, K_h, K_w], content [B, c, V] or None, all bfloat16 ->
// y [B, h V, Ho, Wo] bfloat16: tiled_forward's result with the logits and y rounded to bfloat16 (see above)
torch::Tensor tiled_forward_bf16(torch::Tensor q, torch::Tensor v, torch::Tensor table,
                                 std::optional<torch::Tensor> content, int64_t step) {
  check_arguments("tiled_forward_bf16", q, v, table, content, step, nullptr, torch::kBFloat16);
  q = q.contiguous();
  Shape s(q, v, table, step);
  s.KWs = round_up(s.KW + 1, 2);
  const torch::Tensor lc = content.has_value() ? content_of(content->to(torch::kFloat), s) : torch::Tensor();
  constexpr int W = Vec<float>::lanes;
  const int64_t Rn = s.U * s.KH * s.KWs, Rp = round_up(Rn, W), P = s.plane(), rs = s.width * s.CV;
  const int64_t Cq = (s.C + 1) / 2;  // channel pairs
  auto R2 = table_pairs(table, s.KWs, Rp);
  auto vp = column_pairs(v);
  auto y = torch::empty({s.B, s.H * s.V, s.Ho, s.Wo}, v.options());
  const uint32_t* R2d = reinterpret_cast<const uint32_t*>(R2.data_ptr<int32_t>());
  const float* lcd = lc.defined() ? lc.data_ptr<float>() : nullptr;
  const at::BFloat16* qd = q.data_ptr<at::BFloat16>();
  const uint32_t* vd = reinterpret_cast<const uint32_t*>(vp.data_ptr<int32_t>());
  at::BFloat16* yd = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, s.B * s.Ho * s.runs, 1, [&](int64_t begin, int64_t end) {
    // a run's queries [h, qx, Cq] as channel pairs and (for the content rows) [h, qx, c] in float32, logits
    // [h, qx, Rp] in float32 and bfloat16, outputs [h, V, qx]
    std::vector<float> qp(s.H * s.Tt * s.C), L(s.H * s.Tt * Rp), out(s.H * s.V * s.Tt);
    std::vector<uint16_t> Lb(s.H * s.Tt * Rp);
    std::vector<uint32_t> qp2(s.H * s.Tt * Cq);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (s.Ho * s.runs), oy = i / s.runs % s.Ho, ox0 = i % s.runs * s.Tt;
      const int64_t nq = std::min(s.Tt, s.Wo - ox0);
      if (lcd != nullptr) s.pack_queries(qd, b, oy, ox0, nq, qp.data(), s.C);
      pack_query_pairs(s, reinterpret_cast<const uint16_t*>(qd), b, oy, ox0, nq, qp2.data(), Cq);
      const Scope rows = s.scope(s.step * oy, s.step * ox0);
      run_logits_bf16(s, qp2.data(), Cq, nq, R2d, Rp, rows.y0, rows.y1, L.data());
      const auto [first, last] = s.columns(rows.y0, rows.y1);
      for (int64_t hq = 0; hq < s.H * s.Tt; ++hq) {  // the logits that run_logits wrote, rounded to bfloat16
        if (hq % s.Tt >= nq) continue;
        for (int64_t n = first / W * W; n < round_up(last, W); n += W)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(Lb.data() + hq * Rp + n),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(L.data() + hq * Rp + n)));
      }
      for (int64_t qx = 0; qx < nq; ++qx) {
        const int64_t y0 = s.step * oy, x0 = s.step * (ox0 + qx);
        const Content<float> ct{qp.data() + qx * s.C, s.Tt * s.C, lcd == nullptr ? nullptr : lcd + b * s.C * s.V,
                                s.C};
        aggregate_bf16(Lb.data() + qx * Rp, s.Tt * Rp, vd + b * s.height * rs,
                       (y0 - s.y_lo) * rs + (x0 - s.x_lo) * s.CV,
                       s.H, s.U, s.scope(y0, x0), s.KWs, rs, s.CV, s.V, ct, out.data() + qx, s.Tt, s.V * s.Tt);
      }
      for (int64_t hj = 0; hj < s.H * s.V; ++hj) {
        at::BFloat16* dst = yd + (b * s.H * s.V + hj) * P + oy * s.Wo + ox0;
        for (int64_t qx = 0; qx < nq; ++qx) dst[qx] = at::BFloat16(out[hj * s.Tt + qx]);
      }
    }
  });
  return y;
}
// gradients of tiled_forward_bf16 (gy, q, v, table and content bfloat16) in float32, laid out as the inputs (gcontent
// empty without a content lambda), as a bfloat16 matmul's backward computes them: the logit gradients gy . v, the
// value gradients L^T gy (the logits rounded to bfloat16 as in the forward), and from the logit gradients rounded to
// bfloat16 the query and table gradients, all by VDPBF16PS over pairs (of channels, heads, scope columns, queries)
// with float32 sums; the content rows in float32, as tiled_backward
std::vector<torch::Tensor> tiled_backward_bf16(torch::Tensor gy, torch::Tensor q, torch::Tensor v, torch::Tensor table,
                                               std::optional<torch::Tensor> content, int64_t step) {
  check_arguments("tiled_backward_bf16", q, v, table, content, step, &gy, torch::kBFloat16);
  gy = gy.contiguous(); q = q.contiguous();
  Shape s(q, v, table, step);
  const torch::Tensor lc = content.has_value() ? content_of(content->to(torch::kFloat), s) : torch::Tensor();
  using T = float;
  Backward<T> bw(s, lc, v.options().dtype(torch::kFloat));
  const int64_t Rp = round_up(s.Rn, Vec<T>::lanes), Cp = bw.Cp, P = s.plane(), Hp = bw.Hp, Wp = bw.Wp, Tt = s.Tt;
  const int64_t KWq = round_up(s.KW, QVec<T>::columns);
  // pairs of: channels of q (Cq) and of v (Vp), heads (HP), scope columns (KWp), queries of a run (Qp)
  const int64_t Cq = (s.C + 1) / 2, Vp = (s.V + 1) / 2, CVp = s.U * Vp, HP = (s.H + 1) / 2, KWp = (s.KW + 1) / 2;
  const int64_t Qp = Tt / 2;
  auto R2 = table_pairs(table, s.KW, Rp);
  auto RT2 = column_pair_table(table, Cp);
  const int64_t Wq = (Wp - s.KW) / s.step + Tt + (KWq - 1) / s.step;  // as in tiled_backward
  auto vt = rows_by_phase_pairs(v, s.U, Hp, Wq, s.y_lo, s.x_lo, s.step);
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const uint16_t* gyd = reinterpret_cast<const uint16_t*>(gy.data_ptr<at::BFloat16>());
  const uint32_t* vtd = reinterpret_cast<const uint32_t*>(vt.data_ptr<int32_t>());
  const uint32_t* R2d = reinterpret_cast<const uint32_t*>(R2.data_ptr<int32_t>());
  const uint32_t* RT2d = reinterpret_cast<const uint32_t*>(RT2.data_ptr<int32_t>());
  auto body = [&](int64_t begin, int64_t end) {
    const int tid = at::get_thread_num();
    T *gvp = bw.values(tid, begin, end), *grT = bw.table(tid);
    // as tiled_backward's (qp and gyr for the content rows only), and: the queries as channel pairs [h, Tt, Cq] and
    // as query pairs [h, Qp, Cp] (0 past nq and c), the logits of head pairs in bfloat16 [qx, HP, Rp], the run's
    // output gradients [h, V, qx] (a zero head past H), as channel pairs [h, Vp, qx] and, for one query, as head
    // pairs [HP, V]; a scope row's logit gradients as pairs (logit_grad_pairs)
    std::vector<T> qp(s.H * Tt * Cp), L(s.H * Tt * Rp), gqq(s.H * Tt * Cp), glt(s.H * KWq * Tt);
    std::vector<T> gyr(lc.defined() ? s.H * s.V * Tt : 0);
    std::vector<uint32_t> qp2(s.H * Tt * Cq), qq(s.H * Qp * Cp), Lp(Tt * HP * Rp), gyp(s.H * Vp * Tt), gyq(HP * s.V);
    std::vector<uint32_t> ga(KWp * Tt), gb(s.KW * s.H * Qp);
    std::vector<uint16_t> gy16((2 * HP) * s.V * Tt);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / bw.per_image, oy = i / s.runs % s.Ho, ox0 = i % s.runs * Tt, y0 = s.step * oy;
      const int64_t nq = std::min(Tt, s.Wo - ox0), at = oy * s.Wo + ox0;
      if (lc.defined()) s.pack_queries(reinterpret_cast<const at::BFloat16*>(qd), b, oy, ox0, nq, qp.data(), Cp);
      pack_query_pairs(s, qd, b, oy, ox0, nq, qp2.data(), Cq);
      for (int64_t h = 0; h < s.H; ++h)
        for (int64_t c = 0; c < s.C; ++c) {
          const uint16_t* src = qd + ((b * s.H + h) * s.C + c) * P + at;
          for (int64_t k = 0; k < Qp; ++k)
            qq[(h * Qp + k) * Cp + c] = (2 * k < nq ? uint32_t(src[2 * k]) : 0u) |
                                        (2 * k + 1 < nq ? uint32_t(src[2 * k + 1]) << 16 : 0u);
        }
      const Scope rows = s.scope(y0, s.step * ox0);
      run_logits_bf16(s, qp2.data(), Cq, nq, R2d, Rp, rows.y0, rows.y1, L.data());
      const auto [first, last] = s.columns(rows.y0, rows.y1);
      for (int64_t qx = 0; qx < nq; ++qx)
        for (int64_t p = 0; p < HP; ++p) {
          const T* lo = L.data() + (2 * p * Tt + qx) * Rp;
          const T* hi = 2 * p + 1 < s.H ? lo + Tt * Rp : nullptr;
          for (int64_t n = first / 16 * 16; n < round_up(last, 16); n += 16)
            _mm512_storeu_si512(Lp.data() + (qx * HP + p) * Rp + n,
                                bf16_pairs(_mm512_loadu_ps(lo + n),
                                           hi ? _mm512_loadu_ps(hi + n) : _mm512_setzero_ps()));
        }
      for (int64_t hj = 0; hj < s.H * s.V; ++hj)
        std::memcpy(gy16.data() + hj * Tt, gyd + (b * s.H * s.V + hj) * P + at, nq * sizeof(uint16_t));
      for (int64_t h = 0; h < s.H; ++h)
        for (int64_t j = 0; j < s.V; j += 2) {
          const uint16_t *g0 = gy16.data() + (h * s.V + j) * Tt, *g1 = g0 + Tt;
          uint32_t* d = gyp.data() + (h * Vp + j / 2) * Tt;
          for (int64_t qx = 0; qx < nq; ++qx) d[qx] = uint32_t(g0[qx]) | (j + 1 < s.V ? uint32_t(g1[qx]) << 16 : 0u);
        }
      if (lc.defined())
        for (int64_t hj = 0; hj < s.H * s.V; ++hj)
          for (int64_t qx = 0; qx < nq; ++qx) gyr[hj * Tt + qx] = bf16_to_float(gy16[hj * Tt + qx]);
      std::fill(gqq.begin(), gqq.end(), T(0));
      for (int64_t u = 0; u < s.U; ++u)
        for (int64_t ky = rows.y0; ky < rows.y1; ++ky) {
          run_logit_grads_bf16(gyp.data(), s.H, Vp, vtd + (((b * Hp + y0 + ky) * s.step * CVp) + u * Vp) * Wq + ox0,
                               Wq, CVp * Wq, s.step, KWq, glt.data());
          const int64_t row = u * s.KH + ky, r = row * s.KW;
          for (int64_t h = 0; h < s.H; ++h) {  // as a bfloat16 matmul's backward: the logit gradients rounded
            logit_grad_pairs(glt.data() + h * KWq * Tt, s.KW, nq, ga.data(), gb.data() + h * Qp, s.H * Qp);
            pair_gemm<true>(ga.data(), 1, Tt, RT2d + row * KWp * Cp, Cp, nq, KWp, Cp, gqq.data() + h * Tt * Cp, Cp);
          }
          // the table gradient over the heads' query pairs at once (qq's zero pairs past nq)
          pair_gemm<true>(gb.data(), s.H * Qp, 1, qq.data(), Cp, s.KW, s.H * Qp, Cp, grT + r * Cp, Cp);
        }
      for (int64_t qx = 0; qx < nq; ++qx) {
        const int64_t x0 = s.step * (ox0 + qx);
        for (int64_t p = 0; p < HP; ++p)
          for (int64_t j = 0; j < s.V; ++j) {
            const uint16_t* g = gy16.data() + (2 * p * s.V + j) * Tt + qx;
            gyq[p * s.V + j] = uint32_t(g[0]) | uint32_t(g[s.V * Tt]) << 16;
          }
        scatter_bf16(Lp.data() + qx * HP * Rp, Rp, gyq.data(), HP, s.V, gvp + ((b * Hp + y0) * Wp + x0) * s.CV, s.U,
                     s.scope(y0, x0), Wp * s.CV);
      }
      bw.content_rows(tid, b, gyr.data(), qp.data(), nq, gqq.data());
      bw.store_query_grads(gqq.data(), b, at, nq);
    }
  };
  return bw.run(body, table);
}
#endif
