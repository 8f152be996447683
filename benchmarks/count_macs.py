#!/usr/bin/env python
"""Multiply-adds that the tensor-core kernels of the tiled position lambdas issue, counted without a GPU.

For each launch of a layer step's forward and backward as tiled_triton's wrappers make it (``tc_rows``, its logit
gradient, ``tc_value_grad``, and the GEMMs they leave to torch: the logits ``Q E``, ``dq = E dL``, ``dR = sum q dL^T``)
this counts, from the launch grid and the tile constants of ``tiled_triton.tc_launch_meta``, the multiply-adds of
every ``tl.dot``: tile ``M x N x K`` times the loop's trips times the programs (each program's trips from its own
rows, as the kernel computes them), and compares them with the query-side form's (custom_ops' FLOP formula: per
query ``h u K_h K_w |k|`` logits and a value row of depth ``|v|`` per scope offset that meets the image; the backward
3x the logits, for the logits again, dq and dR, and 2x the values, for dv and the logit gradients). Padding (tiles
rounded up to powers of 2, banded windows, masked rows) is what the ratio measures: the tensor cores issue it all.

The formula is checked against what the kernels do (``--check``, tests/test_count_macs.py): the wrappers run on small
maps under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) with the interpreter's dot counting ``M N K`` of
every call (by call site) and torch's matrix products counted likewise; the two counts must be equal, launch by
launch. The interpreter is too slow for 64 x 64 maps at batch 8: the committed figures are the formula's.

    python benchmarks/count_macs.py --json docs/results/kernel_macs.json   # LambdaResNet-101's 1024 px shapes, batch 8
    TRITON_INTERPRET=1 python benchmarks/count_macs.py --check             # formula == interpreted count, small maps

If tiled_triton's names or launches change, the tool stops with an error naming what it missed (never a silent
count of something else).
"""
import argparse
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from timm_lambda.layers.position_lambda import custom_ops  # noqa: E402
from timm_lambda.layers.position_lambda import tiled_triton as T  # noqa: E402

REQUIRED = ['tc_launch_meta', 'logit_stride', 'forward', 'backward', 'CHUNK_ELEMENTS', 'image_chunks', 'kernels']
_missing = [n for n in REQUIRED if not hasattr(T, n)]
if _missing:
    raise SystemExit(f'count_macs: tiled_triton no longer has {_missing}: the counting formula follows the wrappers '
                     'and must be updated with them')

HEADS, DIM_K, DIM_U = 4, 16, 1
# (name, layer channels, input map side, stride): LambdaResNet-101's lambda layers at 1024 px (c4: 256 ch 64x64;
# c5's first: 512 ch 64x64 at stride 2, the pooled queries 9 |k| deep and the table 25x25; c5: 512 ch 32x32)
SHAPES = [('c4', 256, 64, 1), ('c5_s2', 512, 64, 2), ('c5', 512, 32, 1)]
SCOPE = 23
BATCH = 8
SMS = 132  # an H200's multiprocessors: the small-grid rule of tc_launch_meta (at batch 8 the full grids)
DTYPES = [('bfloat16', torch.bfloat16, 'ieee'), ('tf32', torch.float32, 'tf32')]

# every tl.dot of the kernels, by its first two operands: (kernel, operands) -> what it computes
SITES = {
    ('tc_rows', 'qf3, e'): 'logits',  # fused forward: L = Q E, a batch of output rows
    ('tc_rows', 'a.to(la.dtype), vt'): 'values',  # fused forward: y += A V
    ('tc_rows', 'a, vt'): 'values',  # forward from the logits tensor: y += A V
    ('tc_rows', 'qm, cm'): 'content',  # forward: y += q lambda^c
    ('tc_rows (logit grad)', 'g, tl.trans(vt)'): 'values',  # dA = dY V^T
    ('tc_rows (logit grad)', 'dl, et'): 'logits',  # fused: dq = dL E^T
    ('tc_value_grad', 'g, a'): 'values',  # dv^T += dY^T A
}


def operator_shapes(channels: int, side: int, stride: int, batch: int = BATCH):
    """``(q, v, table)`` shapes of the operator at a layer: ``q [B, h, c, Ho, Wo]``, ``v [B, u V, H, W]``, ``table
    [c, u, K_h, K_w]`` (at stride 2: queries 9 |k| deep, the table 2 wider)."""
    dv, out = channels // 4, -(-side // stride)
    c, kw = (9 * DIM_K, SCOPE + 2) if stride == 2 else (DIM_K, SCOPE)
    return (batch, HEADS, c, out, out), (batch, DIM_U * dv, side, side), (c, DIM_U, kw, kw)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _meta(qs, vs, ts, dtype, precision, images, sms):
    (_, h, c, ho, wo), (_, uv, height, width), (_, u, _, kw) = qs, vs, ts
    step = -(-height // ho) if ho else 1
    meta = T.tc_launch_meta(h, c, uv // u, width, wo, kw, step, dtype, ho, precision, images=images, sms=sms,
                            height=height, u=u)
    for part, keys in (('rows', ('BLOCK_Q', 'BLOCK_H', 'BLOCK_W', 'BLOCK_V', 'BLOCK_Y', 'KWP', 'BLOCK_C', 'FUSED')),
                       ('logit_grad', ('BLOCK_Q', 'BLOCK_H', 'BLOCK_W', 'BLOCK_V', 'BLOCK_Y', 'KWP', 'BLOCK_C',
                                       'FUSED')),
                       ('value_grad', ('BLOCK_P', 'BLOCK_H', 'BLOCK_QC', 'BLOCK_V'))):
        missing = [k for k in keys if k not in meta.get(part, {})]
        if missing:
            raise SystemExit(f'count_macs: tc_launch_meta(...)[{part!r}] has no {missing}: update the formula')
    return meta, step


def formula(qs, vs, ts, dtype, precision='ieee', sms=None, chunk_elements=None):
    """``(sites, grids)``: ``sites[(pass, kernel, dot)]``, the multiply-adds that a training step's forward and
    backward issue at each ``tl.dot`` of each kernel and in each GEMM, from the wrappers' grids and tiles;
    ``grids[(pass, kernel)]``, the launches and programs (``sms``: as launched on a GPU of that many multiprocessors;
    None: off a GPU, as the interpreter launches them; ``chunk_elements``: the wrappers' chunk size, default theirs)."""
    (b, h, c, ho, wo), (_, uv, height, width), (_, u, kh, kw) = qs, vs, ts
    dv, ukk = uv // u, u * kh * kw
    ls = T.logit_stride(ukk)
    sites, grids = {}, {}

    def add(pass_, kernel, dot, macs):
        sites[(pass_, kernel, dot)] = sites.get((pass_, kernel, dot), 0) + macs

    def launch(pass_, kernel, programs):
        g = grids.setdefault((pass_, kernel), dict(launches=0, programs=0))
        g['launches'] += 1
        g['programs'] += programs

    p_y = (kh - 1) // 2
    meta, step = _meta(qs, vs, ts, dtype, precision, None, None)
    fused = meta['rows']['FUSED']
    if fused != meta['logit_grad']['FUSED'] or 'FUSED' in meta['value_grad']:
        raise SystemExit('count_macs: the kernels no longer agree on FUSED: update the formula')
    # the chunks of images a launch (fused forward: one launch), as the wrappers choose them
    chunks = T.image_chunks(b, h * ls * ho * wo, chunk_elements or T.CHUNK_ELEMENTS)
    for pass_, kinds in (('forward', ['rows']), ('backward', ['value_grad', 'logit_grad'])):
        for _, n in [(0, b)] if fused and pass_ == 'forward' else chunks:
            meta, _ = _meta(qs, vs, ts, dtype, precision, n, sms)
            if not fused or pass_ == 'backward':  # the logits tensor by a GEMM: [n h, Ho Wo, C] x [C, LS]
                add(pass_, 'gemm', 'logits Q E', n * h * ho * wo * c * ls)
                launch(pass_, 'gemm', 0)
            for kind in kinds:
                m = meta[kind]
                if kind == 'value_grad':
                    bp, qc = m['BLOCK_P'], m['BLOCK_QC']
                    gx, nvb = _cdiv(width, bp), _cdiv(dv, m['BLOCK_V'])
                    rows_ = 0
                    for r in range(height):  # the output rows that reach value row r
                        top = r + p_y
                        lo = max(0, (top - (kh - 1) + step - 1) >> (step - 1))
                        hi = min(ho - 1, top >> (step - 1))
                        rows_ += max(hi - lo + 1, 0)
                    chunks = 0
                    for x in range(gx):  # the query chunks whose scopes reach each program's columns
                        c0, p_x = x * bp, (kw - 1) // 2
                        q_lo = max(0, (c0 + p_x - kw + 1 + step - 1) >> (step - 1))
                        q_lo -= q_lo % m.get('ALIGN', 1)  # (the chunks from a multiple of ALIGN)
                        q_hi = min(wo - 1, (c0 + bp - 1 + p_x) >> (step - 1))
                        chunks += _cdiv(max(q_hi - q_lo + 1, 0), qc)
                    trips = rows_ * chunks * n * u * nvb
                    launch(pass_, 'tc_value_grad', gx * height * n * u * nvb)
                    # [BV, BH QC] x [BH QC, BP]
                    add(pass_, 'tc_value_grad', 'g, a', trips * m['BLOCK_V'] * m['BLOCK_H'] * qc * bp)
                    continue
                kernel = 'tc_rows' if kind == 'rows' else 'tc_rows (logit grad)'
                rows = m['BLOCK_Y'] * m['BLOCK_H'] * m['BLOCK_Q']
                gx, gy = _cdiv(wo, m['BLOCK_Q']), _cdiv(ho, m['BLOCK_Y'])
                trips = 0
                for y in range(gy):  # the (u, value row) pairs of each program's scopes
                    oy0 = y * m['BLOCK_Y']
                    first = oy0 * step - p_y
                    last = (min(oy0 + m['BLOCK_Y'], ho) - 1) * step - p_y + kh
                    first, last = max(first, 0), min(last, height)  # the value rows in the image only
                    trips += u * max(last - first, 0)
                trips *= gx * n
                launch(pass_, kernel, gx * gy * n)
                window = rows * m['BLOCK_W'] * m['BLOCK_V']  # [R, BW] x [BW, BV] or [R, BV] x [BV, BW]
                # [BY, R / BY, C] x [BY, C, KWP] or [BY, R / BY, KWP] x [BY, KWP, C]: each output row's own scope row
                band = rows * m['BLOCK_C'] * m['KWP']
                if kind == 'rows':
                    if fused:
                        add(pass_, kernel, 'qf3, e', trips * band)
                    add(pass_, kernel, 'a.to(la.dtype), vt' if fused else 'a, vt', trips * window)
                else:
                    add(pass_, kernel, 'g, tl.trans(vt)', trips * window)
                    if fused:
                        add(pass_, kernel, 'dl, et', trips * band)
            if pass_ == 'backward':
                if not fused:  # dq = R dL: [n h, C, u K_h K_w] x [n h, u K_h K_w, Ho Wo]
                    add(pass_, 'gemm', 'dq R dL', n * h * c * ukk * ho * wo)
                    launch(pass_, 'gemm', 0)
                # [C, n h Ho Wo] x [n h Ho Wo, LS] (every operand aligned; the padding columns' products dropped)
                add(pass_, 'gemm', 'dR q dL^T', c * n * h * ho * wo * ls)
                launch(pass_, 'gemm', 0)
    return sites, grids


def content_formula(qs, vs, ts, dtype, precision='ieee', sms=None) -> dict:
    """The forward's fused content term ``q lambda^c`` (one ``tl.dot`` a program): issued and needed."""
    (b, h, c, ho, wo), (_, uv, _, _), (_, u, _, _) = qs, vs, ts
    meta, _ = _meta(qs, vs, ts, dtype, precision, b, sms)
    m = meta['rows']
    programs = _cdiv(wo, m['BLOCK_Q']) * _cdiv(ho, m['BLOCK_Y']) * b
    r = m['BLOCK_Y'] * m['BLOCK_H'] * m['BLOCK_Q']
    return dict(issued=programs * r * m['BLOCK_C'] * m['BLOCK_V'], needed=b * ho * wo * h * c * (uv // u),
                note='the forward\'s content dot (CONTENT), where the caller passes a content lambda of depth c; not '
                'in the position totals')


def _in_image(size: int, queries: int, step: int, k: int) -> int:
    """Scope offsets along one axis that meet the image, summed over the queries (as custom_ops counts them)."""
    lo = (k - 1) // 2
    return sum(max(0, min(k, lo + size - step * q) - max(0, lo - step * q)) for q in range(queries))


def reference_flops(qs, vs, ts, backward: bool):
    """``(name, flops)`` of the project's own FLOP formula for the position term at these operator shapes
    (``custom_ops.flops``, the lambda operator's, without a content lambda)."""
    (b, h, c, ho, _), (_, uv, height, width), (_, u, kh, kw) = qs, vs, ts
    step = -(-height // ho)
    k, pad = (c, 0) if step == 1 else (c // 9, 2)
    # the operator's inputs are the layer's maps: q [B, h k, H, W], v [B, u V, H, W]
    return 'flops', custom_ops.flops((b, h * k, height, width), None, (b, uv, height, width),
                                     (k, u, kh - pad, kw - pad), None, step, False, 'softmax', False, 'tiled',
                                     backward=backward)


def needed(qs, vs, ts) -> dict:
    """The query-side form's multiply-adds: ``logits`` (per query ``h u K_h K_w c``) and ``values`` (``h V`` per
    in-image scope offset); the forward, the backward (3x logits, 2x values) and the training step, each half of the
    project's FLOP formula (:func:`reference_flops`, which must agree)."""
    (b, h, c, ho, wo), (_, uv, height, width), (_, u, kh, kw) = qs, vs, ts
    step = -(-height // ho)
    logits = b * ho * wo * h * u * kh * kw * c
    values = b * h * uv * _in_image(height, ho, step, kh) * _in_image(width, wo, step, kw)
    fwd, bwd = logits + values, 3 * logits + 2 * values
    for macs, backward in ((fwd, False), (bwd, True)):
        name, flops = reference_flops(qs, vs, ts, backward)
        if 2 * macs != flops:
            raise SystemExit(f'count_macs: the query-side form ({2 * macs} FLOPs) differs from custom_ops.{name} '
                             f'({flops}) at q {qs}, v {vs}, table {ts}: update needed()')
    return dict(logits=logits, values=values, forward=fwd, backward=bwd, train=fwd + bwd)


def summarize(sites: dict, grids: dict, need: dict) -> dict:
    """Per launch site (pass, kernel, dot): issued MACs, needed MACs (the part of the query-side form it computes:
    one pass of the logits or of the values), ratio; per pass and for the training step: the totals and their
    ratio."""
    rows = []
    for (pass_, kernel, dot), macs in sorted(sites.items(), key=lambda kv: (kv[0][0] != 'forward',) + kv[0][1:]):
        part = SITES.get((kernel, dot), 'logits')  # (the GEMMs: logits, dq and dR, each one pass of the logits)
        rows.append({'pass': pass_, 'kernel': kernel, 'dot': dot, 'part': part, **grids[(pass_, kernel)],
                     'issued': macs, 'needed': need[part], 'ratio': round(macs / need[part], 3)})
    kernels = {}
    for r in rows:  # per kernel (its dot sites together; the GEMMs each their own)
        name = f"{r['pass']} {r['kernel'] if r['kernel'] != 'gemm' else 'gemm ' + r['dot']}"
        k = kernels.setdefault(name, dict(issued=0, needed=0))
        k['issued'] += r['issued']
        k['needed'] += r['needed']
    for k in kernels.values():
        k['ratio'] = round(k['issued'] / k['needed'], 3)
    tot = {p: sum(m for k, m in sites.items() if k[0] == p) for p in ('forward', 'backward')}
    tot['train'] = tot['forward'] + tot['backward']
    return dict(kernels=kernels, sites=rows, issued=tot,
                needed={k: need[k] for k in ('logits', 'values', 'forward', 'backward', 'train')},
                ratio={k: round(tot[k] / need[k], 3) for k in tot})


FLOOR_NOTE = (
    "floor: the least training-step ratio of any kernels whose products are tl.dot tiles (Triton's: every extent a "
    "power of 2 and at least 16), exact along y. Values: the forward's and the logit gradient's products contract "
    "(forward) or produce (logit gradient) each query row's scope columns in whole blocks of 16, at least "
    "16 ceil(n/16) for n columns of its scope in the map (32 for 23): 'rows'; the value gradient's tiles hold at "
    "least 16 value columns, a block of 16 costs 16 times the queries whose scopes reach it (38 at a 23-wide scope, "
    "for 23 that reach a column) and each column at least its share of the cheapest block that holds it: "
    "'value_grad'. Logits, each of the four passes (logits, again in the backward, dq, dR): a query's at least "
    "min(K_h K_w, n_y 16 ceil(n_x / 16)), all its offsets (a GEMM with the table) or its scope rows in the map in "
    "blocks of 16: 'logits'. floor = (4 logits L + values V (2 rows + value_grad)) / (4 L + 3 V); 'whole_logits': "
    "the same with every logit product whole (1.0x)")


def floor(qs, vs, ts) -> dict:
    """The least issued / needed ratio that tl.dot tiles allow at these shapes (:data:`FLOOR_NOTE`): ``rows``, the
    forward's and logit gradient's values products; ``value_grad``; ``logits``, a logit pass; ``train``, the
    training step's; ``whole_logits``, the training step's with every logit product whole."""
    (_, _, _, ho, wo), (_, _, height, width), (_, _, kh, kw) = qs, vs, ts
    step, p = -(-height // ho), (kw - 1) // 2
    cols = [{step * x - p + k for k in range(kw)} & set(range(width)) for x in range(wo)]  # each query's columns
    n = [len(c) for c in cols]
    rows = sum(16 * _cdiv(x, 16) for x in n) / sum(n)
    reaching = [{x for x in range(wo) if c in cols[x]} for c in range(width)]  # the queries reaching each column
    # a block of 16 columns issues its queries for each of the 16, in the map or not: each column's share of the
    # cheapest block that holds it
    least = [min(16 * len(set().union(*reaching[max(s, 0):s + 16])) / len(range(max(s, 0), min(s + 16, width)))
                 for s in range(c - 15, c + 1)) for c in range(width)]
    value_grad = sum(least) / sum(len(r) for r in reaching)
    n_y = [max(0, min(kh, (kh - 1) // 2 + height - step * y) - max(0, (kh - 1) // 2 - step * y)) for y in range(ho)]
    logits = sum(min(kh * kw, a * 16 * _cdiv(b, 16)) for a in n_y for b in n) / (ho * wo * kh * kw)
    need = needed(qs, vs, ts)
    lo, va = need['logits'], need['values']
    values = va * (2 * rows + value_grad)
    return dict(rows=round(rows, 3), value_grad=round(value_grad, 3), logits=round(logits, 3),
                train=round((4 * lo * logits + values) / need['train'], 3),
                whole_logits=round((4 * lo + values) / need['train'], 3))


def table(batch: int = BATCH, sms: int = SMS) -> list:
    out = []
    for name, channels, side, stride in SHAPES:
        qs, vs, ts = operator_shapes(channels, side, stride, batch)
        need = needed(qs, vs, ts)
        for dname, dtype, prec in DTYPES:
            s = summarize(*formula(qs, vs, ts, dtype, prec, sms), need)
            meta, _ = _meta(qs, vs, ts, dtype, prec, batch, sms)
            out.append(dict(shape=name, channels=channels, map=side, stride=stride, q=list(qs), v=list(vs),
                            table=list(ts), dtype=dname, needed_checked_against='custom_ops.' + reference_flops(
                                qs, vs, ts, False)[0], tiles={k: {x: y for x, y in v.items()
                                                                    if x.startswith(('BLOCK', 'KWP', 'FUSED'))}
                                                                for k, v in meta.items()},
                            content=content_formula(qs, vs, ts, dtype, prec, sms), floor=floor(qs, vs, ts), **s))
    return out


# ----------------------------------------------------------------------------------------------------------
# the check: the kernels under Triton's interpreter, every tl.dot and torch matrix product counted


def interpreted(qs, vs, ts, dtype, precision='ieee', sms=None, chunk_elements=None):
    """Run the wrappers' forward and backward under Triton's interpreter on CPU tensors of these shapes, counting
    ``M N K`` of every ``tl.dot`` by (pass, kernel, call site) and of every torch matrix product (``mm``, ``bmm``,
    ``baddbmm``) by pass: the same keys as :func:`formula` (the GEMMs told apart by their operands' shapes). ``sms``:
    the wrappers launch as on a GPU of that many multiprocessors; ``chunk_elements``: their chunks' size."""
    if not T.INTERPRETED:
        raise SystemExit('count_macs --check: run with TRITON_INTERPRET=1 (set before tiled_triton is imported)')
    import linecache

    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter
    sites, grids, state = {}, {}, dict(pass_=None, kernel=None)
    src = os.path.abspath(T.__file__)

    def add(key, macs):
        sites[key] = sites.get(key, 0) + macs

    def launched(key, programs):
        g = grids.setdefault(key, dict(launches=0, programs=0))
        g['launches'] += 1
        g['programs'] += programs

    original_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args, **kwargs):
        f = sys._getframe(1)
        while f is not None and os.path.abspath(f.f_code.co_filename) != src:
            f = f.f_back
        if f is None:
            raise SystemExit('count_macs: a tl.dot outside tiled_triton.py')
        line = linecache.getline(f.f_code.co_filename, f.f_lineno)
        site = next((dot for kernel, dot in SITES if kernel == state['kernel'] and f'tl.dot({dot},' in line), None)
        if site is None:
            raise SystemExit(f'count_macs: unknown tl.dot at tiled_triton.py:{f.f_lineno} in {state["kernel"]} '
                             f'({line.strip()!r}): the counting formula must be updated with the kernels')
        sa, sb = a.data.shape, b.data.shape
        batch = int(sa[0]) if len(sa) == 3 else 1  # (a batched dot: one product a leading index)
        add((state['pass_'], state['kernel'], site), batch * int(sa[-2]) * int(sa[-1]) * int(sb[-1]))
        return original_dot(self, a, b, d, *args, **kwargs)

    def launch(kernel, run):
        def counted(*args, grid, warmup, **meta):  # (Triton's ``kernel[grid](...)`` calls ``run``)
            if warmup:
                return run(*args, grid=grid, warmup=warmup, **meta)
            name = getattr(getattr(kernel, 'fn', kernel), '__name__', str(kernel)).lstrip('_')
            state['kernel'] = name + (' (logit grad)' if meta.get('LOGIT_GRAD') else '')
            if state['kernel'] not in {k for k, _ in SITES}:
                raise SystemExit(f'count_macs: unknown kernel {state["kernel"]}: update the formula')
            launched((state['pass_'], state['kernel']), grid[0] * grid[1] * grid[2])
            out = run(*args, grid=grid, warmup=warmup, **meta)
            state['kernel'] = None
            return out
        return counted

    class Gemms(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in ('mm', 'bmm', 'baddbmm', 'addmm', 'matmul', 'addbmm'):
                x, y = (args[1], args[2]) if name.startswith('add') or name == 'baddbmm' else (args[0], args[1])
                macs = x.shape[-2] * x.shape[-1] * y.shape[-1] * (x.shape[0] if x.dim() == 3 else 1)
                add((state['pass_'], 'gemm', _gemm_site(x, ts)), macs)
                launched((state['pass_'], 'gemm'), 0)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    q, v = torch.randn(qs, generator=g).to(dtype), torch.randn(vs, generator=g).to(dtype)
    tab = torch.randn(ts, generator=g).to(dtype)
    step = -(-vs[2] // qs[3])
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == 'tf32'
    interpreter.InterpreterBuilder.create_dot = create_dot
    kernels = [T.kernels()[key] for key in ('tc_rows', 'tc_value_grad')]
    for kernel in kernels:
        kernel.run = launch(kernel, kernel.run)
    chunks = chunk_elements or T.CHUNK_ELEMENTS
    try:
        with Gemms():
            state['pass_'] = 'forward'
            y = T.forward(q, v, tab, step, chunk_elements=chunks, sms=sms)
            state['pass_'] = 'backward'
            T.backward(torch.randn(y.shape, generator=g).to(dtype), q, v, tab, step, chunk_elements=chunks, sms=sms)
    finally:
        for kernel in kernels:
            del kernel.run  # (the class's again)
        interpreter.InterpreterBuilder.create_dot = original_dot
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return sites, grids


def _gemm_site(x, ts) -> str:
    """Which of the wrappers' GEMMs a torch matrix product is, from its operands' shapes."""
    c, ukk = ts[0], ts[1] * ts[2] * ts[3]
    if x.dim() == 2:
        return 'dR q dL^T'
    if x.shape[-1] == c:  # [n h, Ho Wo, C] x [C, LS]
        return 'logits Q E'
    if x.shape[-2] == c and x.shape[-1] == ukk:
        return 'dq R dL'
    raise SystemExit(f'count_macs: a matrix product of unknown operands {tuple(x.shape)}: update the formula')


CHECK_CASES = [  # (q, v, table, options) small enough for the interpreter
    ((2, 2, 16, 9, 9), (2, 16, 9, 9), (16, 1, 5, 5), {}),  # stride 1: the kernels compute their logits
    ((1, 3, 18, 5, 5), (1, 24, 10, 10), (18, 1, 7, 7), {}),  # stride 2: the logits, dq and dR by GEMMs
    # |u| 2, 4 heads (16-bit and TF32 tiles differ), a small grid as on a GPU of 64 multiprocessors
    ((2, 4, 8, 7, 7), (2, 40, 7, 7), (8, 2, 5, 5), dict(sms=64)),
    ((2, 2, 18, 4, 4), (2, 16, 8, 8), (18, 1, 5, 5), dict(chunk_elements=1)),  # one image a chunk
    ((1, 1, 8, 4, 4), (1, 136, 4, 4), (8, 1, 3, 3), {}),  # |v| > 128: value-gradient channel blocks on the grid
]


def check(cases=CHECK_CASES, dtypes=DTYPES) -> list:
    """Formula against interpreted counts, every dot site and GEMM, every kernel's launches and programs; raises on
    the first difference. Returns the compared cases."""
    rows = []
    for qs, vs, ts, options in cases:
        for dname, dtype, prec in dtypes:
            want, got = formula(qs, vs, ts, dtype, prec, **options), interpreted(qs, vs, ts, dtype, prec, **options)
            for what, w, g in zip(('multiply-adds', 'launches'), want, got):
                if w != g:
                    diff = {str(k): (w.get(k), g.get(k)) for k in set(w) | set(g) if w.get(k) != g.get(k)}
                    raise AssertionError(f'count_macs: formula != interpreted ({what}) at q {qs}, v {vs}, table {ts}, '
                                         f'{dname}: {diff}')
            macs = sum(got[0].values())
            rows.append(dict(q=list(qs), v=list(vs), table=list(ts), dtype=dname, sites=len(got[0]), macs=macs,
                             **options))
            print(f'check q {qs} v {vs} table {ts} {options} {dname}: {len(got[0])} dot sites and GEMMs, {macs} '
                  'multiply-adds: formula == interpreted', flush=True)
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--json', default=None, help='write the table here (e.g. docs/results/kernel_macs.json)')
    p.add_argument('--check', action='store_true', help='formula == interpreted count (TRITON_INTERPRET=1)')
    args = p.parse_args(argv)
    if args.check:
        check()
        return
    from harness.measure import commit, cpu_model
    rows = table()
    for r in rows:
        print(f"{r['shape']:6s} {r['dtype']:8s} issued/needed: forward {r['ratio']['forward']:.2f}x, backward "
              f"{r['ratio']['backward']:.2f}x, training step {r['ratio']['train']:.2f}x; per kernel: "
              + ', '.join(f"{k} {v['ratio']:.2f}x" for k, v in r['kernels'].items())
              + f"; floor {r['floor']['train']:.2f}x (values products {r['floor']['rows']:.2f}x, value gradient "
              f"{r['floor']['value_grad']:.2f}x, logits {r['floor']['logits']:.2f}x; whole logits "
              f"{r['floor']['whole_logits']:.2f}x)")
        for x in r['sites']:
            print(f"    {x['pass']:8s} {x['kernel']:21s} {x['dot']:20s} {x['part']:6s} {x['issued'] / 1e9:8.2f} G of "
                  f"{x['needed'] / 1e9:7.2f} G: {x['ratio']:.2f}x")
    if args.json:
        record = dict(command='python benchmarks/count_macs.py ' + ' '.join(argv), date=time.strftime(
            '%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(), machine=dict(
            cpu=cpu_model(), python=platform.python_version(), torch=torch.__version__, note='counted, not timed: '
            'no GPU needed'), batch=BATCH, sms=SMS, heads=HEADS, dim_k=DIM_K, dim_u=DIM_U, scope=SCOPE,
            floor_note=FLOOR_NOTE, rows=rows)
        with open(args.json, 'w') as f:
            json.dump(record, f, indent=1)
        print(f'wrote {args.json}')


if __name__ == '__main__':
    main()
