// The tiled position lambdas' CPU kernels in float32 and float64 (tiled_cpu.h says what they compute), and the
// module's bindings.
#include "tiled_cpu.h"

namespace {
using namespace tiled_cpu;

// out[(h0 + m) KWq + kx0 + k][q] = sum_j gy[h0 + m][j][q] v[j bs + off[k] + q] for m < MB, k < KB, q < 8 (off[k]: the
// window of scope column kx0 + k)
template <typename T, int MB, int KB>
__attribute__((noinline)) void logit_grad_tile(const T* __restrict gy, int64_t V, const T* __restrict v, int64_t bs,
                                               const int64_t* off, T* __restrict out, int64_t KWq) {
  constexpr int Q = QVec<T>::lanes;
  qvec_t<T> acc[MB][KB];
  int64_t o[KB];
  for (int k = 0; k < KB; ++k) o[k] = off[k];
  for (int m = 0; m < MB; ++m) for (int k = 0; k < KB; ++k) acc[m][k] = qvec_t<T>{};
  for (int64_t j = 0; j < V; ++j) {
    qvec_t<T> g[MB];
    for (int m = 0; m < MB; ++m) g[m] = loadq(gy + (m * V + j) * Q);
    for (int k = 0; k < KB; ++k) {
      qvec_t<T> w = loadq(v + j * bs + o[k]);
      KEEP_IN_REGISTER(w);
      for (int m = 0; m < MB; ++m) acc[m][k] += g[m] * w;
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int k = 0; k < KB; ++k) std::memcpy(out + (m * KWq + k) * Q, &acc[m][k], sizeof(acc[m][k]));
}

// glt[h][kx][q] = sum_j gy[h][j][q] v[j, ky, step (ox0 + q) + kx] for kx < KWq (whole blocks), q < 8: the values v
// of one scope row with columns split by phase (column c at c % step, c / step: rows of Wq per phase, channel stride
// bs), starting at the run's first query
template <typename T>
void run_logit_grads(const T* gy, int64_t H, int64_t V, const T* v, int64_t bs, int64_t ps, int64_t step, int64_t KWq,
                     T* glt) {
  constexpr int Q = QVec<T>::lanes, KB = QVec<T>::columns, MB = QVec<T>::rows;
  for (int64_t kx0 = 0; kx0 < KWq; kx0 += KB) {
    int64_t off[KB];
    for (int k = 0; k < KB; ++k) off[k] = (kx0 + k) % step * ps + (kx0 + k) / step;
    int64_t h = 0;
    if constexpr (MB > 1)
      for (; h + MB <= H; h += MB)
        logit_grad_tile<T, MB, KB>(gy + h * V * Q, V, v, bs, off, glt + (h * KWq + kx0) * Q, KWq);
    for (; h < H; ++h) logit_grad_tile<T, 1, KB>(gy + h * V * Q, V, v, bs, off, glt + (h * KWq + kx0) * Q, KWq);
  }
}

// y[h * osh + j * osj] = sum_{u, ky, kx} L[h * ls + (u, ky, kx)] v[vo + ky * rs + kx U V + u V + j] for h < MB (vo:
// the scope's origin, possibly before v's first element; every offset read lies in the image), plus the content rows
template <typename T, int MB, int NV>
inline void aggregate_tile(const T* __restrict L, int64_t ls, const T* __restrict v, int64_t vo, int64_t U,
                           const Scope& sc, int64_t rs, int64_t V, int64_t j0, const Content<T>& ct,
                           T* __restrict out, int64_t osj, int64_t osh) {
  constexpr int W = Vec<T>::lanes;
  vec_t<T> acc[MB][NV];
  for (int m = 0; m < MB; ++m) for (int i = 0; i < NV; ++i) acc[m][i] = vec_t<T>{};
  if (ct.lc != nullptr)
    for (int64_t c = 0; c < ct.C; ++c) {
      vec_t<T> vv[NV];
      for (int i = 0; i < NV; ++i) { vv[i] = loadv(ct.lc + c * V + j0 + i * W); KEEP_IN_REGISTER(vv[i]); }
      for (int m = 0; m < MB; ++m) { T l = ct.q[m * ct.qs + c]; for (int i = 0; i < NV; ++i) acc[m][i] += l * vv[i]; }
    }
  for (int64_t u = 0; u < U; ++u)
    for (int64_t ky = sc.y0; ky < sc.y1; ++ky)
      for (int64_t kx = sc.x0, r = (u * sc.KH + ky) * sc.KW + sc.x0; kx < sc.x1; ++kx, ++r) {
        const T* vx = v + (vo + ky * rs + kx * U * V + u * V + j0);
        vec_t<T> vv[NV];
        for (int i = 0; i < NV; ++i) { vv[i] = loadv(vx + i * W); KEEP_IN_REGISTER(vv[i]); }
        for (int m = 0; m < MB; ++m) { T l = L[m * ls + r]; for (int i = 0; i < NV; ++i) acc[m][i] += l * vv[i]; }
      }
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < NV; ++i)
      for (int e = 0; e < W; ++e) out[m * osh + (j0 + i * W + e) * osj] = acc[m][i][e];
}

template <typename T>
void aggregate(const T* L, int64_t ls, const T* v, int64_t vo, int64_t H, int64_t U, const Scope& sc, int64_t rs,
               int64_t V, const Content<T>& content, T* out, int64_t osj, int64_t osh) {
  auto rows = [&](int64_t h) { return Content<T>{content.q + h * content.qs, content.qs, content.lc, content.C}; };
  for_tiles<Vec<T>::lanes, TILE_ROWS>(
      H, V,
      [&](auto mb, auto nv, int64_t h, int64_t j) {
        aggregate_tile<T, decltype(mb)::value, decltype(nv)::value>(L + h * ls, ls, v, vo, U, sc, rs, V, j, rows(h),
                                                                    out + h * osh, osj, osh);
      },
      [&](auto mb, int64_t h, int64_t j) {
        const Content<T> ct = rows(h);
        for (int m = 0; m < decltype(mb)::value; ++m) {
          T acc = 0;
          if (ct.lc != nullptr)
            for (int64_t c = 0; c < ct.C; ++c) acc += ct.q[m * ct.qs + c] * ct.lc[c * V + j];
          for (int64_t u = 0; u < U; ++u)
            for (int64_t ky = sc.y0; ky < sc.y1; ++ky)
              for (int64_t kx = sc.x0; kx < sc.x1; ++kx)
                acc += L[(h + m) * ls + (u * sc.KH + ky) * sc.KW + kx] * v[vo + ky * rs + kx * U * V + u * V + j];
          out[(h + m) * osh + j * osj] = acc;
        }
      });
}

// v[(u, ky, kx) position, j] += sum_h L[h * ls + (u, ky, kx)] gy[h * V + j], j in [j0, j0 + NV lanes), h < MB
template <typename T, int MB, int NV>
__attribute__((noinline)) void scatter_tile(const T* __restrict L, int64_t ls, const T* __restrict gy, int64_t V,
                                            T* __restrict v, int64_t U, const Scope& sc, int64_t rs, int64_t j0) {
  constexpr int W = Vec<T>::lanes;
  vec_t<T> g[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int i = 0; i < NV; ++i) {
      g[m][i] = loadv(gy + m * V + j0 + i * W);
      KEEP_IN_REGISTER(g[m][i]);
    }
  for (int64_t u = 0; u < U; ++u)
    for (int64_t ky = sc.y0; ky < sc.y1; ++ky)
      for (int64_t kx = sc.x0, r = (u * sc.KH + ky) * sc.KW + sc.x0; kx < sc.x1; ++kx, ++r) {
        T* dst = v + ky * rs + kx * U * V + u * V + j0;
        vec_t<T> acc[NV];
        for (int i = 0; i < NV; ++i) acc[i] = loadv(dst + i * W);
        for (int m = 0; m < MB; ++m) { T l = L[m * ls + r]; for (int i = 0; i < NV; ++i) acc[i] += l * g[m][i]; }
        for (int i = 0; i < NV; ++i) storev(dst + i * W, acc[i]);
      }
}

template <typename T>
void scatter(const T* L, int64_t ls, const T* gy, int64_t H, int64_t V, T* v, int64_t U, const Scope& sc, int64_t rs) {
  for_tiles<Vec<T>::lanes, TILE_ROWS>(
      H, V,
      [&](auto mb, auto nv, int64_t h, int64_t j) {
        scatter_tile<T, decltype(mb)::value, decltype(nv)::value>(L + h * ls, ls, gy + h * V, V, v, U, sc, rs, j);
      },
      [&](auto mb, int64_t h, int64_t j) {
        for (int64_t u = 0; u < U; ++u)
          for (int64_t ky = sc.y0; ky < sc.y1; ++ky)
            for (int64_t kx = sc.x0; kx < sc.x1; ++kx) {
              T acc = 0;
              for (int m = 0; m < decltype(mb)::value; ++m)
                acc += L[(h + m) * ls + (u * sc.KH + ky) * sc.KW + kx] * gy[(h + m) * V + j];
              v[ky * rs + kx * U * V + u * V + j] += acc;
            }
      });
}

// table [C, U, K_h, K_w] (any strides: the window of a larger table that the map reaches) -> [C, Rp] rows (u, ky, kx),
// or transposed -> [Rn, Cp] (columns c), zero padded: one pass, no ATen copies (each costs a microsecond of host time
// on a small map)
template <typename T, bool Transposed>
torch::Tensor padded_table(const torch::Tensor& table, int64_t Rp, int64_t Cp = 0) {
  const int64_t C = table.size(0), U = table.size(1), KH = table.size(2), KW = table.size(3), Rn = U * KH * KW;
  const int64_t s0 = table.stride(0), s1 = table.stride(1), s2 = table.stride(2), s3 = table.stride(3);
  auto r = Transposed ? torch::empty({Rn, Cp}, table.options()) : torch::empty({C, Rp}, table.options());
  const T* src = table.data_ptr<T>();
  T* d = r.data_ptr<T>();
  if (Transposed) std::fill(d, d + Rn * Cp, T(0));
  for (int64_t c = 0; c < C; ++c) {
    int64_t n = 0;
    for (int64_t u = 0; u < U; ++u)
      for (int64_t ky = 0; ky < KH; ++ky)
        for (int64_t kx = 0; kx < KW; ++kx, ++n) {
          const T x = src[c * s0 + u * s1 + ky * s2 + kx * s3];
          if (Transposed) d[n * Cp + c] = x; else d[c * Rp + n] = x;
        }
    if (!Transposed) std::fill(d + c * Rp + Rn, d + (c + 1) * Rp, T(0));
  }
  return r;
}

template <typename T>
torch::Tensor rows_by_phase(const torch::Tensor& v, int64_t Hp, int64_t Wq, int64_t y0, int64_t x0, int64_t step) {
  const int64_t sb = v.stride(0), sc = v.stride(1), sy = v.stride(2), sx = v.stride(3);
  const T* src = v.data_ptr<T>();
  return rows_by_phase_of<T>(v.size(0), v.size(1), v.size(2), v.size(3), Hp, Wq, y0, x0, step, v.options(),
                             [&](int64_t b, int64_t c, int64_t y, int64_t x) {
                               return src[b * sb + c * sc + y * sy + x * sx];
                             });
}

}  // namespace

// q [B, h, c, Ho, Wo], v [B, u V, H, W], table [c, u, K_h, K_w], content [B, c, V] or None -> y [B, h V, Ho, Wo]
torch::Tensor tiled_forward(torch::Tensor q, torch::Tensor v, torch::Tensor table, std::optional<torch::Tensor> content,
                            int64_t step) {
  check_arguments("tiled_forward", q, v, table, content, step);
  q = q.contiguous();
  Shape s(q, v, table, step);
  const torch::Tensor lc = content_of(content, s);
  auto y = torch::empty({s.B, s.H * s.V, s.Ho, s.Wo}, v.options());
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "tiled_forward", [&] {
    using T = scalar_t;
    auto vl = to_channels_last<T>(v);  // channels last: a scope's rows are whole channel vectors
    const int64_t Rp = round_up(s.Rn, Vec<T>::lanes), P = s.plane(), rs = s.width * s.CV;
    auto R = padded_table<T, false>(table, Rp);
    const T *Rp_ = R.data_ptr<T>(), *qd = q.data_ptr<T>(), *vd = vl.data_ptr<T>();
    const T* lcd = lc.defined() ? lc.data_ptr<T>() : nullptr;
    T* yd = y.data_ptr<T>();
    at::parallel_for(0, s.B * s.Ho * s.runs, 1, [&](int64_t begin, int64_t end) {
      // a run's queries [h, qx, c], logits [h, qx, Rp] and outputs [h, V, qx]
      std::vector<T> qp(s.H * s.Tt * s.C), L(s.H * s.Tt * Rp), out(s.H * s.V * s.Tt);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / (s.Ho * s.runs), oy = i / s.runs % s.Ho, ox0 = i % s.runs * s.Tt;
        const int64_t nq = std::min(s.Tt, s.Wo - ox0);
        s.pack_queries(qd, b, oy, ox0, nq, qp.data(), s.C);
        const Scope rows = s.scope(s.step * oy, s.step * ox0);  // the run's scope rows that meet the image
        s.run_logits(qp.data(), s.C, nq, Rp_, Rp, rows.y0, rows.y1, L.data());
        for (int64_t qx = 0; qx < nq; ++qx) {
          const int64_t y0 = s.step * oy, x0 = s.step * (ox0 + qx);
          const Content<T> ct{qp.data() + qx * s.C, s.Tt * s.C, lcd == nullptr ? nullptr : lcd + b * s.C * s.V, s.C};
          aggregate<T>(L.data() + qx * Rp, s.Tt * Rp, vd + b * s.height * rs, (y0 - s.y_lo) * rs + (x0 - s.x_lo) * s.CV,
                       s.H, s.U, s.scope(y0, x0), rs, s.V, ct, out.data() + qx, s.Tt, s.V * s.Tt);
        }
        for (int64_t hj = 0; hj < s.H * s.V; ++hj)
          std::memcpy(yd + (b * s.H * s.V + hj) * P + oy * s.Wo + ox0, out.data() + hj * s.Tt, nq * sizeof(T));
      }
    });
  });
  return y;
}

// gradients of tiled_forward: gy [B, h V, Ho, Wo] -> (gq, gv, gtable, gcontent), each laid out as its input
// (gcontent empty without a content lambda)
std::vector<torch::Tensor> tiled_backward(torch::Tensor gy, torch::Tensor q, torch::Tensor v, torch::Tensor table,
                                          std::optional<torch::Tensor> content, int64_t step) {
  check_arguments("tiled_backward", q, v, table, content, step, &gy);
  gy = gy.contiguous(); q = q.contiguous();
  Shape s(q, v, table, step);
  const torch::Tensor lc = content_of(content, s);
  std::vector<torch::Tensor> grads;
  AT_DISPATCH_FLOATING_TYPES(v.scalar_type(), "tiled_backward", [&] {
    using T = scalar_t;
    constexpr int W = Vec<T>::lanes;
    Backward<T> bw(s, lc, v.options());
    const int64_t Rp = round_up(s.Rn, W), Cp = bw.Cp, P = s.plane(), Hp = bw.Hp, Wp = bw.Wp;
    const int64_t Tt = s.Tt, KWq = round_up(s.KW, QVec<T>::columns);
    static_assert(Shape::Tt == QVec<T>::lanes, "a run's queries are the lanes of the logit gradients");
    auto R = padded_table<T, false>(table, Rp);
    auto RT = padded_table<T, true>(table, 0, Cp);
    // zero-padded rows of channels, each row's columns split by phase (column c at (c % step, c / step)) so that the
    // queries of a run meet consecutive columns: [B, Hp, step, CV, Wq]
    // (the last query's window reads up to column (Wp - KW) / step + Tt - 1 + (KWq - 1) / step; that is past the image's
    // last column, (Wp - 1) / step, since Tt > 2)
    const int64_t Wq = (Wp - s.KW) / s.step + Tt + (KWq - 1) / s.step;
    auto vt = rows_by_phase<T>(v, Hp, Wq, s.y_lo, s.x_lo, s.step);
    const T *Rd = R.data_ptr<T>(), *RTd = RT.data_ptr<T>(), *qd = q.data_ptr<T>();
    const T *vtd = vt.data_ptr<T>(), *gyd = gy.data_ptr<T>();
    auto body = [&](int64_t begin, int64_t end) {
      const int tid = at::get_thread_num();
      T *gvp = bw.values(tid, begin, end), *grT = bw.table(tid);
      // a run's queries [h, qx, Cp] (channel pads 0), logits [h, qx, Rp], output gradients [h, V, qx] and one query's
      // [h, V], query gradients [h, qx, Cp], logit gradients of one scope row [h, kx, qx]
      std::vector<T> qp(s.H * Tt * Cp), L(s.H * Tt * Rp), gyr(s.H * s.V * Tt), gyq(s.H * s.V), gqq(s.H * Tt * Cp);
      std::vector<T> glt(s.H * KWq * Tt);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / bw.per_image, oy = i / s.runs % s.Ho, ox0 = i % s.runs * Tt, y0 = s.step * oy;
        const int64_t nq = std::min(Tt, s.Wo - ox0), at = oy * s.Wo + ox0;
        s.pack_queries(qd, b, oy, ox0, nq, qp.data(), Cp);
        const Scope rows = s.scope(y0, s.step * ox0);  // the run's scope rows that meet the image
        s.run_logits(qp.data(), Cp, nq, Rd, Rp, rows.y0, rows.y1, L.data());  // the logits again, [h, qx, Rp]
        for (int64_t hj = 0; hj < s.H * s.V; ++hj)  // the run's output gradients [h, V, qx]
          std::memcpy(gyr.data() + hj * Tt, gyd + (b * s.H * s.V + hj) * P + at, nq * sizeof(T));
        std::fill(gqq.begin(), gqq.end(), T(0));
        // per scope row that meets the image: the logit gradients glt[h, kx, qx] = gy[h, :, qx] . v[ky, kx, u, :] of
        // the run's queries at once (0 outside the image), then the query gradients gq[h, qx, :] += glt[h, :, qx] R^T
        // and the table gradient gR^T[(u, ky, kx), :] += glt[h, kx, :] q[h, :, :] (over the run's nq queries)
        for (int64_t u = 0; u < s.U; ++u)
          for (int64_t ky = rows.y0; ky < rows.y1; ++ky) {
            run_logit_grads<T>(gyr.data(), s.H, s.V, vtd + (((b * Hp + y0 + ky) * s.step * s.CV) + u * s.V) * Wq + ox0,
                               Wq, s.CV * Wq, s.step, KWq, glt.data());
            const int64_t r = (u * s.KH + ky) * s.KW;
            for (int64_t h = 0; h < s.H; ++h) {
              const T* g = glt.data() + h * KWq * Tt;
              gemm<T, true>(g, 1, Tt, RTd + r * Cp, Cp, nq, s.KW, Cp, gqq.data() + h * Tt * Cp, Cp);
              gemm<T, true>(g, Tt, 1, qp.data() + h * Tt * Cp, Cp, s.KW, nq, Cp, grT + r * Cp, Cp);
            }
          }
        for (int64_t qx = 0; qx < nq; ++qx) {
          const int64_t x0 = s.step * (ox0 + qx);
          for (int64_t hj = 0; hj < s.H * s.V; ++hj) gyq[hj] = gyr[hj * Tt + qx];
          // value gradients: gv[ky, kx, u, :] += sum_h L[h, (u, ky, kx)] gy[h, :]
          scatter<T>(L.data() + qx * Rp, Tt * Rp, gyq.data(), s.H, s.V, gvp + ((b * Hp + y0) * Wp + x0) * s.CV, s.U,
                     s.scope(y0, x0), Wp * s.CV);
        }
        bw.content_rows(tid, b, gyr.data(), qp.data(), nq, gqq.data());
        bw.store_query_grads(gqq.data(), b, at, nq);
      }
    };
    grads = bw.run(body, table);
  });
  return grads;
}

// The operator at stride 1 in one call, float32 and float64 (each ATen call from Python costs a few microseconds of
// host time on a small map; a layer training step made 13 of them around the kernels): the table's reach, the content
// lambda of the normalised keys (eq. 1, Table 11) plus `shared`, and the kernels. Layouts of the layer's own maps: q
// [B, h k, H, W], keys [B, u k, H, W] or None, v [B, u V, H, W], the whole table [k, u, R_h, R_w] (odd sides; the window
// that an H x W map reaches, |dy| <= H - 1 and |dx| <= W - 1, is taken here), shared [B, k, V] or None; key_norm
// 'softmax', 'l2' or 'none'.
namespace {

struct Layer {
  int64_t B, HK, H, W, K, U, V, heads;
  int norm;  // 0 softmax, 1 l2, 2 none
};

Layer check_layer_arguments(const char* name, const torch::Tensor& q, const std::optional<torch::Tensor>& keys,
                            const torch::Tensor& v, const torch::Tensor& table,
                            const std::optional<torch::Tensor>& shared, const std::string& key_norm) {
  const int norm = key_norm == "softmax" ? 0 : key_norm == "l2" ? 1 : key_norm == "none" ? 2 : -1;
  TORCH_CHECK_VALUE(norm >= 0, name, ": key_norm must be 'softmax', 'l2' or 'none', got '", key_norm, "'");
  TORCH_CHECK_VALUE(q.dim() == 4, name, ": q must be [B, h k, H, W], got ", q.sizes());
  TORCH_CHECK_VALUE(v.dim() == 4, name, ": v must be [B, u V, H, W], got ", v.sizes());
  TORCH_CHECK_VALUE(table.dim() == 4 && table.size(0) >= 1 && table.size(1) >= 1 && table.size(2) % 2 == 1 &&
                        table.size(3) % 2 == 1,
                    name, ": table must be [k, u, R_h, R_w] with odd sides, got ", table.sizes());
  const int64_t B = q.size(0), HK = q.size(1), H = q.size(2), W = q.size(3), K = table.size(0), U = table.size(1);
  TORCH_CHECK_VALUE(HK >= K && HK % K == 0 && H >= 1 && W >= 1, name,
                    ": q must be [B, h k, H, W] with h k a multiple of the table's k and a map of at least 1x1, got q ",
                    q.sizes(), ", table ", table.sizes());
  TORCH_CHECK_VALUE(v.size(0) == B && v.size(1) >= U && v.size(1) % U == 0 && v.size(2) == H && v.size(3) == W, name,
                    ": v must be [B, u V, H, W] with q's B, H, W and a multiple of the table's u, got v ", v.sizes(),
                    ", q ", q.sizes(), ", table ", table.sizes());
  const Layer l{B, HK, H, W, K, U, v.size(1) / U, HK / K, norm};
  std::vector<std::pair<const char*, const torch::Tensor*>> all{{"v", &v}, {"table", &table}};
  if (keys.has_value()) {
    all.push_back({"keys", &*keys});
    TORCH_CHECK_VALUE(keys->dim() == 4 && keys->size(0) == B && keys->size(1) == U * K && keys->size(2) == H &&
                          keys->size(3) == W,
                      name, ": keys must be [B, u k, H, W] = [", B, ", ", U * K, ", ", H, ", ", W, "], got ",
                      keys->sizes());
  }
  if (shared.has_value()) {
    all.push_back({"shared", &*shared});
    TORCH_CHECK_VALUE(shared->dim() == 3 && shared->size(0) == B && shared->size(1) == K && shared->size(2) == l.V,
                      name, ": shared must be [B, k, V] = [", B, ", ", K, ", ", l.V, "], got ", shared->sizes());
  }
  for (const auto& [what, t] : all) {
    TORCH_CHECK_TYPE(t->device().is_cpu(), name, ": ", what, " must be a CPU tensor, got one on ", t->device());
    TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type(), name, ": ", what, " must be ", q.scalar_type(),
                     " (q's dtype), got ", t->scalar_type());
  }
  TORCH_CHECK_TYPE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, name,
                   ": the tensors must be float32 or float64, got ", q.scalar_type());
  return l;
}

// the offsets of table [k, u, R_h, R_w] an H x W map reaches, |dy| <= H - 1, |dx| <= W - 1 (a view; fused.reach)
torch::Tensor reach(const torch::Tensor& table, int64_t H, int64_t W) {
  const int64_t ch = (table.size(2) - 1) / 2, cw = (table.size(3) - 1) / 2;
  const int64_t rh = std::min(ch, H - 1), rw = std::min(cw, W - 1);
  if (rh == ch && rw == cw) return table;
  return table.as_strided({table.size(0), table.size(1), 2 * rh + 1, 2 * rw + 1}, table.strides(),
                          table.storage_offset() + (ch - rh) * table.stride(2) + (cw - rw) * table.stride(3));
}

// a map [B, C, H, W] whose rows of H W positions are contiguous (a channel slice of the projection is; else a copy)
torch::Tensor rows_of(const torch::Tensor& x) {
  return x.stride(3) == 1 && x.stride(2) == x.size(3) ? x : x.contiguous();
}

template <typename T>
T dot(const T* __restrict a, const T* __restrict b, int64_t n) {
  constexpr int W = Vec<T>::lanes;
  vec_t<T> acc{};
  int64_t i = 0;
  for (; i + W <= n; i += W) acc += loadv(a + i) * loadv(b + i);
  T s = 0;
  for (int e = 0; e < W; ++e) s += acc[e];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// rows of about this many multiply-adds or more a task (smaller calls run on the calling thread)
int64_t grain(int64_t per_row) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, per_row)); }

constexpr double L2_EPS = 1e-12;  // F.normalize's

// The normalised keys' rows: kn [B, u, k, n] (softmax, l2), or the keys' own rows (none)
template <typename T>
struct KeyRows {
  const T* data;
  int64_t sb, sc, n, UK;  // row (b, u k + c) at data + b sb + (u k + c) sc
  const T* operator()(int64_t r) const { return data + r / UK * sb + r % UK * sc; }
};

template <typename T>
KeyRows<T> key_rows(const Layer& l, const torch::Tensor& keys, const torch::Tensor& kn) {
  const torch::Tensor& x = l.norm == 2 ? keys : kn;
  return {x.data_ptr<T>(), x.stride(0), l.norm == 2 ? x.stride(1) : l.H * l.W, l.H * l.W, l.U * l.K};
}

// {lambda^c + shared [B, k, V] (or shared, or undefined), the normalised keys [B, u, k, n] (undefined without keys
// or with key_norm 'none')} (eq. 1, Table 11: fused.content_lambda), in loops (no ATen call but the results'
// allocations); keys: rows_of'd
template <typename T>
std::pair<torch::Tensor, torch::Tensor> content_lambda(const Layer& l, const std::optional<torch::Tensor>& keys,
                                                       const torch::Tensor& v_,
                                                       const std::optional<torch::Tensor>& shared) {
  if (!keys.has_value()) return {shared.has_value() ? *shared : torch::Tensor(), torch::Tensor()};
  const int64_t n = l.H * l.W;
  const torch::Tensor v = rows_of(v_);
  torch::Tensor kn;
  if (l.norm != 2) {
    kn = torch::empty({l.B, l.U, l.K, n}, v.options());
    const KeyRows<T> in{keys->data_ptr<T>(), keys->stride(0), keys->stride(1), n, l.U * l.K};
    T* knd = kn.data_ptr<T>();
    at::parallel_for(0, l.B * l.U * l.K, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {  // row (b, u k + c), normalised over the positions
        const T* x = in(r);
        T* out = knd + r * n;
        if (l.norm == 0) {
          T m = x[0], sum = 0;
          for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
          for (int64_t i = 0; i < n; ++i) sum += (out[i] = std::exp(x[i] - m));
          const T inv = T(1) / sum;
          for (int64_t i = 0; i < n; ++i) out[i] *= inv;
        } else {
          const T inv = T(1) / std::max<T>(std::sqrt(dot(x, x, n)), T(L2_EPS));
          for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
        }
      }
    });
  }
  const KeyRows<T> rows = key_rows<T>(l, *keys, kn);
  auto content = torch::empty({l.B, l.K, l.V}, v.options());
  const torch::Tensor sh = shared.has_value() ? shared->contiguous() : torch::Tensor();  // (an expanded bias: a copy)
  const T *vd = v.data_ptr<T>(), *sd = sh.defined() ? sh.data_ptr<T>() : nullptr;
  T* cd = content.data_ptr<T>();
  const int64_t vb = v.stride(0), vc = v.stride(1);
  at::parallel_for(0, l.B * l.K, grain(l.U * l.V * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {  // content[b, c, j] = sum_u sum_n kn[b, u, c, n] v[b, u V + j, n]
      const int64_t b = r / l.K, c = r % l.K;
      for (int64_t j = 0; j < l.V; ++j) {
        T acc = sd != nullptr ? sd[r * l.V + j] : T(0);
        for (int64_t u = 0; u < l.U; ++u)
          acc += dot(rows((b * l.U + u) * l.K + c), vd + b * vb + (u * l.V + j) * vc, n);
        cd[r * l.V + j] = acc;
      }
    }
  });
  return {content, kn};
}

// the content lambda's part of the gradients (fused.content_grads): gv [B, u V, H, W] (the kernel's, contiguous) +=
// sum_c gc[b, c, j] kn[b, u, c, :]; -> gkeys [B, u k, H, W], the key norm's backward of gkn[b, u, c, :] = sum_j gc[b,
// c, j] v[b, u V + j, :] (keys: rows_of'd; kn: content_lambda's)
template <typename T>
torch::Tensor content_grads(const Layer& l, const torch::Tensor& gc_, const torch::Tensor& v_,
                            const torch::Tensor& keys, const torch::Tensor& kn, torch::Tensor& gv) {
  const int64_t n = l.H * l.W;
  const torch::Tensor gc = gc_.contiguous(), v = rows_of(v_);
  auto gkeys = torch::empty({l.B, l.U * l.K, l.H, l.W}, v.options());
  const KeyRows<T> rows = key_rows<T>(l, keys, kn);
  const KeyRows<T> raw{keys.data_ptr<T>(), keys.stride(0), keys.stride(1), n, l.U * l.K};
  const T *gcd = gc.data_ptr<T>(), *vd = v.data_ptr<T>();
  T *gkd = gkeys.data_ptr<T>(), *gvd = gv.data_ptr<T>();
  const int64_t vb = v.stride(0), vc = v.stride(1);
  at::parallel_for(0, l.B * l.U * l.K, grain(l.V * n), [&](int64_t begin, int64_t end) {
    std::vector<T> g(n);
    for (int64_t r = begin; r < end; ++r) {  // row (b, u, c)
      const int64_t b = r / (l.U * l.K), u = r / l.K % l.U, c = r % l.K;
      T* out = gkd + r * n;
      T* acc = l.norm == 2 ? out : g.data();  // ('none': the keys' gradient itself)
      std::fill(acc, acc + n, T(0));
      for (int64_t j = 0; j < l.V; ++j) {
        const T w = gcd[(b * l.K + c) * l.V + j], *x = vd + b * vb + (u * l.V + j) * vc;
        for (int64_t i = 0; i < n; ++i) acc[i] += w * x[i];
      }
      if (l.norm == 2) continue;
      const T* p = rows(r);
      const T d = dot(g.data(), p, n);
      if (l.norm == 0) {
        for (int64_t i = 0; i < n; ++i) out[i] = p[i] * (g[i] - d);
      } else {  // F.normalize's: (g - kn <g, kn>) / max(|x|, eps), the inner product 0 where |x| < eps (clamped)
        const T norm = std::sqrt(dot(raw(r), raw(r), n));
        const T inner = norm >= T(L2_EPS) ? d : T(0), inv = T(1) / std::max(norm, T(L2_EPS));
        for (int64_t i = 0; i < n; ++i) out[i] = (g[i] - p[i] * inner) * inv;
      }
    }
  });
  at::parallel_for(0, l.B * l.U * l.V, grain(l.K * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {  // row (b, u, j)
      const int64_t b = r / (l.U * l.V), u = r / l.V % l.U, j = r % l.V;
      T* out = gvd + r * n;
      for (int64_t c = 0; c < l.K; ++c) {
        const T w = gcd[(b * l.K + c) * l.V + j], *p = rows((b * l.U + u) * l.K + c);
        for (int64_t i = 0; i < n; ++i) out[i] += w * p[i];
      }
    }
  });
  return gkeys;
}

// the whole table's gradient [k, u, R_h, R_w] from its window's (contiguous), zero past the reach
template <typename T>
torch::Tensor whole_table_grad(const torch::Tensor& g, const torch::Tensor& table) {
  if (g.sizes() == table.sizes()) return g;
  auto out = torch::empty(table.sizes(), g.options());
  const int64_t KH = table.size(2), KW = table.size(3), kh = g.size(2), kw = g.size(3);
  const int64_t oy = (KH - kh) / 2, ox = (KW - kw) / 2;
  const T* src = g.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  std::fill(dst, dst + out.numel(), T(0));
  for (int64_t p = 0; p < table.size(0) * table.size(1); ++p)
    for (int64_t y = 0; y < kh; ++y)
      std::memcpy(dst + (p * KH + oy + y) * KW + ox, src + (p * kh + y) * kw, kw * sizeof(T));
  return out;
}

std::optional<torch::Tensor> rows_of(const std::optional<torch::Tensor>& x) {
  return x.has_value() ? std::optional<torch::Tensor>(rows_of(*x)) : std::nullopt;
}

}  // namespace

// -> {y [B, h V, H, W], the content lambda [B, k, V] (None without keys and shared), the normalised keys [B, u, k, H W]
// (None without keys, and for key_norm 'none': the backward reads the keys)}
std::vector<std::optional<torch::Tensor>> layer_forward(torch::Tensor q, std::optional<torch::Tensor> keys,
                                                        torch::Tensor v, torch::Tensor table,
                                                        std::optional<torch::Tensor> shared, std::string key_norm) {
  const Layer l = check_layer_arguments("layer_forward", q, keys, v, table, shared, key_norm);
  keys = rows_of(keys);
  std::pair<torch::Tensor, torch::Tensor> ck;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "layer_forward", [&] { ck = content_lambda<scalar_t>(l, keys, v, shared); });
  const auto& [content, kn] = ck;
  auto y = tiled_forward(q.view({l.B, l.heads, l.K, l.H, l.W}), v, reach(table, l.H, l.W),
                         content.defined() ? std::optional<torch::Tensor>(content) : std::nullopt, 1);
  auto some = [](const torch::Tensor& x) { return x.defined() ? std::optional<torch::Tensor>(x) : std::nullopt; };
  return {y, some(content), some(kn)};
}

// gy [B, h V, H, W] and what layer_forward returned besides y (content, kn: None to recompute them) -> the gradients
// {gq, gkeys, gv, gtable (the whole table's: zero past the reach), gshared} (None for a None input)
std::vector<std::optional<torch::Tensor>> layer_backward(torch::Tensor gy, torch::Tensor q,
                                                         std::optional<torch::Tensor> keys, torch::Tensor v,
                                                         torch::Tensor table, std::optional<torch::Tensor> shared,
                                                         std::optional<torch::Tensor> content,
                                                         std::optional<torch::Tensor> kn, std::string key_norm) {
  const Layer l = check_layer_arguments("layer_backward", q, keys, v, table, shared, key_norm);
  const int64_t n = l.H * l.W;
  TORCH_CHECK_VALUE(gy.dim() == 4 && gy.size(0) == l.B && gy.size(1) == l.heads * l.V && gy.size(2) == l.H &&
                        gy.size(3) == l.W,
                    "layer_backward: gy must be the output's gradient [B, h V, H, W] = [", l.B, ", ", l.heads * l.V,
                    ", ", l.H, ", ", l.W, "], got ", gy.sizes());
  TORCH_CHECK_TYPE(gy.device().is_cpu() && gy.scalar_type() == q.scalar_type(),
                   "layer_backward: gy must be a CPU tensor of q's dtype, got ", gy.scalar_type(), " on ", gy.device());
  const bool has_content = keys.has_value() || shared.has_value(), has_kn = keys.has_value() && l.norm != 2;
  // what the forward kept: each None or the forward's (content without keys or shared, kn without normalised keys:
  // wrong)
  TORCH_CHECK_VALUE(!content.has_value() || (has_content && content->dim() == 3 && content->size(0) == l.B &&
                                             content->size(1) == l.K && content->size(2) == l.V),
                    "layer_backward: content must be None or the forward's [B, k, V] = [", l.B, ", ", l.K, ", ", l.V,
                    "]", has_content ? "" : " (a call with neither keys nor shared has none)", ", got ",
                    content.has_value() ? content->sizes() : c10::IntArrayRef{});
  TORCH_CHECK_VALUE(!kn.has_value() || (has_kn && kn->dim() == 4 && kn->size(0) == l.B && kn->size(1) == l.U &&
                                        kn->size(2) == l.K && kn->size(3) == n),
                    "layer_backward: kn must be None or the forward's [B, u, k, n] = [", l.B, ", ", l.U, ", ", l.K,
                    ", ", n, "]", has_kn ? "" : " (a call without keys or with key_norm 'none' has none)", ", got ",
                    kn.has_value() ? kn->sizes() : c10::IntArrayRef{});
  for (const auto& [what, t] : {std::pair<const char*, const std::optional<torch::Tensor>*>{"content", &content},
                                {"kn", &kn}})
    TORCH_CHECK_TYPE(!t->has_value() || ((*t)->device().is_cpu() && (*t)->scalar_type() == q.scalar_type()),
                     "layer_backward: ", what, " must be None or a CPU tensor of q's dtype, got ",
                     (*t)->scalar_type(), " on ", (*t)->device());
  keys = rows_of(keys);
  std::vector<std::optional<torch::Tensor>> out;
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "layer_backward", [&] {
    using T = scalar_t;
    torch::Tensor lc = content.value_or(torch::Tensor()), kt = kn.value_or(torch::Tensor());
    if (has_content && (!lc.defined() || (has_kn && !kt.defined())))  // (not kept: recomputed)
      std::tie(lc, kt) = content_lambda<T>(l, keys, v, shared);
    else if (kt.defined())
      kt = kt.contiguous();
    auto g = tiled_backward(gy, q.view({l.B, l.heads, l.K, l.H, l.W}), v, reach(table, l.H, l.W),
                            has_content ? std::optional<torch::Tensor>(lc) : std::nullopt, 1);
    // g: {gq [B, h, k, H, W], gv [B, u V, H, W], gtable (the window's), gcontent [B, k, V]}, each new and contiguous
    std::optional<torch::Tensor> gkeys;
    if (keys.has_value()) gkeys = content_grads<T>(l, g[3], v, *keys, kt, g[1]);
    out = {g[0].view({l.B, l.HK, l.H, l.W}), gkeys, g[1], whole_table_grad<T>(g[2], table),
           shared.has_value() ? std::optional<torch::Tensor>(g[3]) : std::nullopt};
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tiled_forward", &tiled_forward);
  m.def("tiled_backward", &tiled_backward);
  m.def("layer_forward", &layer_forward);
  m.def("layer_backward", &layer_backward);
  m.def("isa_macros", &tiled_cpu::isa_macros);
  m.attr("vector_bytes") = TILED_CPU_VECTOR_BYTES;
#if defined(__AVX512BF16__)
  m.def("tiled_forward_bf16", &tiled_forward_bf16);
  m.def("tiled_backward_bf16", &tiled_backward_bf16);
  m.def("tiled_forward_brgemm", &tiled_forward_brgemm, py::arg("q"), py::arg("v"), py::arg("table"),
        py::arg("content"), py::arg("step"), py::arg("block") = std::vector<int64_t>{});
  m.def("tiled_backward_brgemm", &tiled_backward_brgemm, py::arg("gy"), py::arg("q"), py::arg("v"), py::arg("table"),
        py::arg("content"), py::arg("step"), py::arg("block") = std::vector<int64_t>{});
  m.def("brgemm_bf16_isa", &brgemm_bf16_isa);
  m.def("amx_tile_data_permitted", &amx_tile_data_permitted);
  m.attr("bf16") = true;
#else
  m.attr("bf16") = false;
#endif
}
