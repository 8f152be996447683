"""Where a lambda layer's GPU time goes, and what the tensor-core kernels' tiles, warps and pipeline stages are worth.

Four parts, at LambdaResNet-101's three lambda-layer shapes at 1024 px, batch 8 (the GPU check runs them, issue 37):

* ``profile``: the CUDA kernels of one layer training step (float32 with TF32, and bfloat16 autocast), by
  ``torch.profiler``: each kernel's device time a step and its launches, summed by name (the Triton kernels, cuBLAS,
  batch norm, softmax...), beside the 3x3 conv's step; the aten operators that launched them by input shapes
  (which GEMM a slow cuBLAS kernel belongs to); the host's side: a step's wall time unprofiled and each operator's
  own CPU time (CUDA runtime calls included), where the eager step's time goes beyond its kernels.
* ``sweep``: each tensor-core kernel (``tc_rows``, its logit-gradient variant, ``tc_value_grad``) alone, timed by
  ``triton.testing.do_bench`` (CUDA events, median) at the constants the wrappers launch (``tc_launch_meta``) and at
  a few alternatives: other pipeline stages and warps, other tiles, and at stride 1 the GEMM path instead of the
  fused kernels (``FUSED=False``: the forward and value gradient timed with their logits GEMM, the logit gradient
  with its ``dq`` GEMM). Each alternative's result is compared with the default's (a wrong tile fails, it is not
  timed). The best per kernel and shape is what the wrappers should launch.
* ``host`` (seconds): the host's microseconds a call of an aten op, a Triton launch and a layer / conv training step
  on tiny inputs (what the eager step's time is made of), and the functions in which the layer step spends its own
  host time (``cProfile``: our wrappers' Python, Triton's launcher, torch's operators).
* ``occupancy`` (before the sweep, it is short): batch 1, each kernel at the tiles of ``tc_launch_meta``'s small-grid
  rule against the full-grid tiles, where they differ (the rule's worth where a grid has fewer programs than the
  GPU has multiprocessors).

All stop at ``--budget`` seconds, the JSON written after each row. ``--dry-run``: a CPU at tiny shapes, the kernels
under Triton's interpreter (every path runs; the comparison of alternatives is real, the times are not).

    python benchmarks/tune_tc_kernels.py --out DIR [--budget 100] [--dry-run]
"""
import argparse
import json
import os
import sys
import time

if '--dry-run' in sys.argv:
    os.environ.setdefault('TRITON_INTERPRET', '1')  # before timm_lambda loads: the kernels run on CPU tensors

import torch  # noqa: E402

from harness.measure import commit, machine  # noqa: E402
from timm_lambda.layers import LambdaLayer, set_backend  # noqa: E402
from timm_lambda.layers.position_lambda import tiled_triton as T  # noqa: E402

HEADS, DIM_K, SCOPE = 4, 16, 23
KERNELS = {'tc_rows': 'rows', 'tc_rows (logit grad)': 'logit_grad', 'tc_value_grad': 'value_grad'}  # -> tc_launch_meta


def shapes(dry_run: bool):
    """(name, width, input side, stride) of LambdaResNet-101's lambda layers at 1024 px (tiny in a dry run)."""
    if dry_run:
        return [('c4', 128, 17, 1), ('c5_s2', 256, 18, 2)]
    return [('c4', 256, 64, 1), ('c5_s2', 512, 64, 2), ('c5', 512, 32, 1)]


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# ----------------------------------------------------------------------------------------------------------
# profile: where a layer step's device time goes


def profile(rows: list, save, budget: Budget, dry_run: bool, batch: int, device: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == 'cuda' else [])
    for name, width, side, stride in shapes(dry_run):
        for dtype in (torch.float32,) if dry_run else (torch.float32, torch.bfloat16):
            if budget.left() < 10:
                return
            torch.manual_seed(0)
            x = torch.randn(batch, width, side, side, device=device, requires_grad=True)
            for module in ('lambda', 'conv3x3'):
                m = (LambdaLayer(width, dim_k=DIM_K, heads=HEADS, scope=SCOPE, stride=stride) if module == 'lambda'
                     else torch.nn.Conv2d(width, width, 3, stride, 1, bias=False)).to(device)

                def step():
                    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
                        y = m(x)
                    y.float().sum().backward()
                for _ in range(3):
                    step()
                steps = 5
                if device == 'cuda':
                    torch.cuda.synchronize()
                t0 = time.perf_counter()  # the wall time of a step, unprofiled (against the device time below)
                for _ in range(steps):
                    step()
                if device == 'cuda':
                    torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) / steps * 1e6
                with torch_profile(activities=activities, record_shapes=True) as prof:
                    for _ in range(steps):
                        step()
                    if device == 'cuda':
                        torch.cuda.synchronize()
                kernels = {}
                for e in prof.key_averages():
                    if device == 'cuda':  # the kernels themselves (their operators' device time would count twice)
                        if getattr(e, 'device_type', None) != torch.autograd.DeviceType.CUDA:
                            continue
                        us = e.self_device_time_total
                    else:  # a dry run: the operators, no times
                        if not e.key.startswith('aten::'):
                            continue
                        us = 0.0
                    kernels[e.key] = dict(us_per_step=round(us / steps, 2), launches_per_step=e.count / steps)
                # the aten operators that launched them, by input shapes: which GEMM a slow kernel is (their own
                # kernels' device time; on a CPU, the operators with no time)
                ops, host = {}, {}
                for e in prof.key_averages():  # the host: each operator's own CPU time a step
                    if e.self_cpu_time_total > 0:
                        host[e.key] = round(e.self_cpu_time_total / steps, 1)
                for e in prof.key_averages(group_by_input_shape=True):
                    us = e.self_device_time_total if device == 'cuda' else 0.0
                    if e.key.startswith('aten::') and (us > 0 or device != 'cuda'):
                        ops[f'{e.key} {e.input_shapes}'] = dict(us_per_step=round(us / steps, 2),
                                                                calls_per_step=e.count / steps)
                total = sum(k['us_per_step'] for k in kernels.values())
                top = dict(sorted(kernels.items(), key=lambda kv: -kv[1]['us_per_step'])[:25])
                rows.append(dict(part='profile', shape=name, module=module, dtype=str(dtype).replace('torch.', ''),
                                 batch=batch, device_us_per_step=round(total, 1), wall_us_per_step=round(wall, 1),
                                 host_cpu_us_per_step=round(sum(host.values()), 1),
                                 host_top=dict(sorted(host.items(), key=lambda kv: -kv[1])[:15]),
                                 launches_per_step=sum(k['launches_per_step'] for k in kernels.values()),
                                 kernels=top, ops=dict(sorted(ops.items(), key=lambda kv: -kv[1]['us_per_step'])[:15])))
                save()


# ----------------------------------------------------------------------------------------------------------
# sweep: the tensor-core kernels alone


def _operands(width, side, stride, batch, dtype, device):
    g = torch.Generator(device='cpu').manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    c = 9 * DIM_K if stride == 2 else DIM_K
    kw = SCOPE + 2 * (stride == 2)
    dv = width // HEADS
    ho = wo = -(-side // stride)
    q, v, table = randn(batch, HEADS, c, ho, wo), randn(batch, dv, side, side), randn(c, 1, kw, kw) / c ** 0.5
    gy, content = randn(batch, HEADS * dv, ho, wo), randn(batch, c, dv)
    return dict(q=q, v=v, table=table, gy=gy, content=content, c=c, kw=kw, dv=dv, ho=ho, wo=wo, side=side,
                step=stride, batch=batch)


def _pow2(n: int, least: int = 1) -> int:
    """The least power of 2 >= max(n, least)."""
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _alternatives(kernel: str, default: dict, o: dict):
    """The default constants and a few alternatives: pipeline stages, warps, tiles."""
    out = [dict(default)]
    for stages in (1, 2, 3, 4):  # (Triton's default: 3)
        if stages != default.get('num_stages', 3):
            out.append(dict(default, num_stages=stages))
    out.append(dict(default, num_warps=8 if default['num_warps'] == 4 else 4))
    if kernel == 'tc_value_grad':
        for bp in (16, 32):  # value columns a program (the contraction: the queries that reach them)
            if bp != default['BLOCK_P'] and bp <= _pow2(o['side'], 16):
                out.append(dict(default, BLOCK_P=bp))
        for qc in (default['BLOCK_QC'] // 2, default['BLOCK_QC'] * 2):  # queries a contraction step
            if 16 <= default['BLOCK_H'] * qc <= 64:
                out.append(dict(default, BLOCK_QC=qc))
        for bv in (32, 64, 128):
            if bv != default['BLOCK_V'] and bv <= _pow2(o['dv'], 16):
                out.append(dict(default, BLOCK_V=bv))
    else:
        for bq in (default['BLOCK_Q'] // 2, default['BLOCK_Q'] * 2):
            if 16 <= default['BLOCK_H'] * bq <= 128:
                bw = _pow2(o['step'] * (bq - 1) + o['kw'], 16)  # (ALIGN 2 needs one window column more)
                align = default.get('ALIGN', 1) if o['step'] * (bq - 1) + o['kw'] + 1 <= bw else 1
                out.append(dict(default, BLOCK_Q=bq, BLOCK_W=bw, ALIGN=align))
        for by in (1, 2, 4):  # output rows a program (they share each value tile)
            if by != default['BLOCK_Y'] and by * default['BLOCK_H'] * default['BLOCK_Q'] <= 128:
                out.append(dict(default, BLOCK_Y=by))
    if default.get('FUSED'):  # the logits from a GEMM and read back (timed with the GEMM), as before 2026-11-28
        out.append(dict(default, FUSED=False, num_warps=4 if kernel == 'tc_rows' else default['num_warps']))
    return out


def _runner(kernel: str, o: dict, prec: str, meta: dict):
    """A function that runs ``kernel`` once with the constants ``meta`` and returns its output."""
    k = T.kernels()
    cdiv = _cdiv
    q, v, table, gy = o['q'], o['v'], o['table'], o['gy']
    b, side, ho, wo, dv, c, kw, step = o['batch'], o['side'], o['ho'], o['wo'], o['dv'], o['c'], o['kw'], o['step']
    tp = T.padded_table(table)
    logits = T.query_major_logits(q, tp)
    ls = logits.shape[-1]
    widen = T.widens(q.dtype)
    gemm = False  # the logits GEMM timed with the kernel, where the kernel does not compute the logits itself
    if kernel == 'tc_value_grad':
        out = torch.empty(v.shape, device=v.device, dtype=torch.float32 if widen else v.dtype)
        grid = (cdiv(side, meta['BLOCK_P']), side, b * cdiv(dv, meta['BLOCK_V']))
        gemm = True  # (it reads the logits GEMM's tensor since issue 53)
        args = [logits, gy, out, side, side, ho, wo, HEADS, 1, dv, kw, kw, ls, step, prec]
    elif kernel == 'tc_rows':
        out = torch.empty(gy.shape, device=v.device, dtype=torch.float32 if widen else v.dtype)
        content = o['content'] if step == 1 else None
        grid = (cdiv(wo, meta['BLOCK_Q']), cdiv(ho, meta['BLOCK_Y']), b)
        gemm = not meta.get('FUSED')
        args = [tp if meta.get('FUSED') else logits, v, out, q, logits if content is None else content, side, side,
                ho, wo, HEADS, 1, dv, c, kw, kw, ls, step, prec]
        meta = dict(meta, CONTENT=content is not None)
    else:  # the logit-gradient variant of tc_rows (zeros: it writes no padding column, which is compared too)
        out = torch.zeros(logits.shape, device=v.device, dtype=torch.float32 if widen else v.dtype)
        grid = (cdiv(wo, meta['BLOCK_Q']), cdiv(ho, meta['BLOCK_Y']), b)
        # fused: dq into its own buffer from the table as it is; else the dq GEMM timed with the kernel
        dq = torch.empty(q.shape, device=q.device, dtype=torch.float32 if widen else q.dtype)
        args = [out, v, gy, dq if meta.get('FUSED') else q, table.reshape(c, -1) if meta.get('FUSED') else out,
                side, side, ho, wo, HEADS, 1, dv, c, kw, kw, ls, step, prec]
    fn = k['tc_value_grad' if kernel == 'tc_value_grad' else 'tc_rows']
    ukk = table[0].numel()
    dq_gemm = kernel == 'tc_rows (logit grad)' and not meta.get('FUSED')

    def run():
        if gemm:
            args[0] = T.query_major_logits(q, tp)
        fn[grid](*args, WIDEN=widen, **meta)
        if dq_gemm:
            rm = tp[:, :ukk].to(out.dtype)
            torch.bmm(rm.expand(out.shape[0], *rm.shape), out[:, :, :ukk].transpose(1, 2))
        return out
    return run


def _time(kernel: str, o: dict, prec: str, options: list, dtype, device: str, budget: Budget):
    """Each option (the first the reference) run and compared with the first's result, then timed on a GPU
    (``do_bench``, median ms); one that fails or differs is recorded with its error. None: out of budget."""
    if device == 'cuda':
        from triton.testing import do_bench
    want = None
    timed = []
    for option in options:
        if budget.left() < 5:
            return None
        run = _runner(kernel, o, prec, option)
        try:
            got = run().float().clone()
        except Exception as e:  # a config that does not compile or fit: recorded, not timed
            timed.append(dict(config=option, error=f'{type(e).__name__}: {str(e)[:300]}'))
            continue
        if want is None:
            want = got
        else:
            err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            if not err <= (1e-2 if dtype == torch.bfloat16 else 2e-3):
                timed.append(dict(config=option, error=f'differs from the default by {err:.2e}'))
                continue
        ms = do_bench(run, warmup=10, rep=40, return_mode='median') if device == 'cuda' else None
        timed.append(dict(config=option, ms=ms))
    return timed


def _dtypes(dry_run: bool):
    return ((torch.float32, 'tf32'),) if dry_run else ((torch.bfloat16, 'ieee'), (torch.float32, 'tf32'))


def _sms(device: str) -> int:
    return T.sm_count(torch.device(device)) or 132  # (a dry run: an H100's or H200's)


def sweep(rows: list, save, budget: Budget, dry_run: bool, batch: int, device: str) -> None:
    for dtype, prec in _dtypes(dry_run):
        for name, width, side, stride in shapes(dry_run):
            o = _operands(width, side, stride, batch, dtype, device)
            meta = T.tc_launch_meta(HEADS, o['c'], o['dv'], side, o['wo'], o['kw'], stride, dtype, o['ho'], prec,
                                    images=batch, sms=_sms(device))  # what the wrappers launch
            for kernel in KERNELS:
                default = dict(meta[KERNELS[kernel]])
                options = _alternatives(kernel, default, o)
                if dry_run:  # the interpreter: the default, another tiling and the unfused forward (results compared)
                    options = [options[0]] + [x for x in options if any(x.get(k) != v for k, v in default.items()
                                                                         if k.startswith("BLOCK"))][:1] + [
                        x for x in options if x.get('FUSED') != default.get('FUSED')]
                timed = _time(kernel, o, prec, options, dtype, device, budget)
                if timed is None:
                    return
                ok = [t for t in timed if t.get('ms') is not None]
                best = min(ok, key=lambda t: t['ms']) if ok else None
                rows.append(dict(part='sweep', shape=name, dtype=str(dtype).replace('torch.', ''), batch=batch,
                                 kernel=kernel, default=timed[0] if timed else None, best=best,
                                 speedup=round(timed[0]['ms'] / best['ms'], 3) if best and timed[0].get('ms') else None,
                                 configs=timed))
                save()


def occupancy(rows: list, save, budget: Budget, dry_run: bool, device: str) -> None:
    """Batch 1: each kernel at the tiles the wrappers launch on this GPU (``tc_launch_meta``'s small-grid rule: fewer
    output rows or value channels a program while a grid has fewer programs than the GPU multiprocessors) against
    the full-grid tiles (batch 8's), where the two differ: ``speedup`` is the full grid's time over the rule's."""
    for dtype, prec in _dtypes(dry_run):
        for name, width, side, stride in shapes(dry_run):
            o = _operands(width, side, stride, 1, dtype, device)
            args = (HEADS, o['c'], o['dv'], side, o['wo'], o['kw'], stride, dtype, o['ho'], prec)
            small, full = T.tc_launch_meta(*args, images=1, sms=_sms(device)), T.tc_launch_meta(*args)
            for kernel in KERNELS:
                options = [dict(small[KERNELS[kernel]]), dict(full[KERNELS[kernel]])]
                if options[0] == options[1]:
                    continue
                timed = _time(kernel, o, prec, options, dtype, device, budget)
                if timed is None:
                    return
                ms = [t.get('ms') for t in timed]
                rows.append(dict(part='occupancy', shape=name, dtype=str(dtype).replace('torch.', ''), batch=1,
                                 kernel=kernel, sms=_sms(device), configs=timed,
                                 speedup=round(ms[1] / ms[0], 3) if len(ms) == 2 and None not in ms else None))
                save()


def host(rows: list, save, budget: Budget, dry_run: bool, device: str) -> None:
    """What a call costs the host (the eager layer step is host-bound on a GPU: docs/benchmarks.md, "GPU"): tiny
    inputs, many calls, one synchronisation at the end, so the device keeps up and the time a call is the host's (a
    median of 5 rounds): an aten elementwise add, a small bmm, one ``tc_rows`` launch through Triton's launcher (the
    wrappers' constants), and a lambda layer's and a 3x3 conv's training step on a 2x2 map (256 channels). With a
    layer step's operator and launch counts (benchmarks/count_launches.py), what its eager time is made of."""
    def sync():
        if device == 'cuda':
            torch.cuda.synchronize()

    def per_call(fn, calls):
        fn()
        sync()
        out = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            out.append((time.perf_counter() - t0) / calls * 1e6)
        return round(sorted(out)[2], 1)

    a, b = torch.ones(8, device=device), torch.ones(4, 8, 8, device=device)
    o = _operands(64, 2, 1, 1, torch.float32, device)
    prec = 'tf32' if device == 'cuda' else 'ieee'
    launch = _runner('tc_rows', o, prec, T.tc_launch_meta(HEADS, o['c'], o['dv'], 2, 2, o['kw'], 1, torch.float32, 2,
                                                           prec)['rows'])
    x = torch.randn(1, 256, 2, 2, device=device, requires_grad=True)
    layer = LambdaLayer(256, dim_k=DIM_K, heads=HEADS, scope=SCOPE).to(device)
    conv = torch.nn.Conv2d(256, 256, 3, 1, 1, bias=False).to(device)

    def step(m):
        return lambda: m(x).sum().backward()
    cases = [('aten add', lambda: torch.add(a, a), 200), ('aten bmm 4x8x8', lambda: torch.bmm(b, b), 200),
             ('triton tc_rows launch', launch, 3 if dry_run else 200),
             ('lambda layer training step 2x2', step(layer), 3 if dry_run else 50),
             ('conv3x3 training step 2x2', step(conv), 3 if dry_run else 50)]
    out = {}
    for name, fn, calls in cases:
        if budget.left() < 5:
            break
        out[name] = per_call(fn, calls)
    rows.append(dict(part='host', device=device, host_us_per_call=out, python_top=_python_top(step(layer), 20)))
    save()


def _python_top(fn, calls: int, top: int = 15) -> dict:
    """The functions in which ``calls`` runs of ``fn`` spend their own host time, by ``cProfile`` (Python and the
    C functions it calls: torch's operators, Triton's launcher): ``{'file:line(function)': us a call}``, the
    ``top`` largest. Where an eager step's host time goes beyond its operators' (the profile part's ``host_top``)."""
    import cProfile
    import pstats
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
    rows = sorted(((tt, f'{os.path.basename(k[0])}:{k[1]}({k[2]})') for k, (_, _, tt, _, _) in stats.items()),
                  reverse=True)[:top]
    return {name: round(tt / calls * 1e6, 1) for tt, name in rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--out', required=True, help='folder for tune_tc_kernels.json')
    p.add_argument('--budget', type=float, default=100, help='seconds for both parts (default: %(default)s)')
    p.add_argument('--parts', nargs='+', default=['profile', 'host', 'occupancy', 'sweep'],
                   choices=['profile', 'host', 'occupancy', 'sweep'])
    p.add_argument('--dry-run', action='store_true', help='a CPU, tiny shapes, the kernels interpreted')
    args = p.parse_args(argv)
    device = 'cpu' if args.dry_run else 'cuda'
    if device == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    set_backend('triton_tc' if device == 'cuda' else 'auto', strict=device == 'cuda')
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, 'tune_tc_kernels.json')
    rows: list = []
    record = dict(command='python benchmarks/tune_tc_kernels.py ' + ' '.join(argv if argv is not None
                                                                             else sys.argv[1:]),
                  date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(),
                  machine=machine(device), rows=rows)

    def save():
        with open(path, 'w') as f:
            json.dump(record, f, indent=1)
    budget = Budget(args.budget)
    batch = 1 if args.dry_run else 8
    save()
    if 'profile' in args.parts:
        profile(rows, save, budget, args.dry_run, batch, device)
    if 'host' in args.parts:
        host(rows, save, budget, args.dry_run, device)
    if 'occupancy' in args.parts:
        occupancy(rows, save, budget, args.dry_run, device)
    if 'sweep' in args.parts:
        sweep(rows, save, budget, args.dry_run, batch, device)
    record['complete'] = budget.left() > 0
    save()
    print(f'tune_tc_kernels: {len(rows)} rows in {path}')


if __name__ == '__main__':
    main()
