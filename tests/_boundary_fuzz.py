"""Run by tests/test_operator_boundary.py in a process of its own: both registered operators
(``torch.ops.timm_lambda.lambda_layer`` and ``lambda_layer_backward``) called directly with inconsistent arguments,
each case in a forked child (this process runs no parallel region first, so the children may use OpenMP; one torch
thread), on the backends named in the arguments. A child reports one line: the error's type and message, or
whether its result equals the plain ops' (the same form, computed in the child) and is the same in a second run.
Crashes show as signals. Prints one JSON line per case, then ``done <n>``.

    python tests/_boundary_fuzz.py <backend> [<backend> ...] [--cases N] [--seed S] [--asan-build DIR]

``--asan-build DIR``: build the CPU kernel with AddressSanitizer into DIR (about 2 minutes) and let it serve
``cpu_kernel`` (the process needs ``LD_PRELOAD`` of the sanitizer's runtime: tests/test_operator_boundary.py).
"""
import argparse
import json
import os
import random
import signal
import sys

if '--asan-build' in sys.argv:  # Triton's library throws C++ exceptions at import that ASan's interceptor aborts on
    sys.modules['triton'] = None  # (torch does without it; these calls run no Triton)

import torch  # noqa: E402

torch.set_num_threads(1)  # before anything runs: no OpenMP pool in this (forking) process

from timm_lambda.layers import position_lambda as PL  # noqa: E402
from timm_lambda.layers.position_lambda import cpu_kernel, lambdas_plain  # noqa: E402

OP, OP_BACKWARD = torch.ops.timm_lambda.lambda_layer, torch.ops.timm_lambda.lambda_layer_backward
NAMES = ('q', 'keys', 'v', 'table', 'shared', 'stride', 'count_include_pad', 'key_norm', 'global_scope', 'form',
         'backend', 'variant', 'compute_dtype', 'tiling')


def base(rng: random.Random, backend: str) -> dict:
    """A consistent call: the layer's maps, a table, its plan (the one the layer would make) as arguments."""
    form = 'dense' if backend == 'gemm' and rng.random() < 0.3 else 'tiled'
    b, h, k, u, dv = rng.choice([1, 2]), rng.choice([1, 2, 3]), rng.choice([2, 3]), rng.choice([1, 2]), rng.choice(
        [1, 3])
    height, width, stride = rng.randint(1, 9), rng.randint(1, 9), rng.choice([1, 2])
    global_scope = rng.random() < 0.2
    side = (2 * height - 1, 2 * width - 1) if global_scope else (rng.choice([1, 3, 5, 7]),) * 2
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    dtype = torch.float32 if backend == 'triton_tc' else torch.float64  # (the tensor cores: no float64)
    t = dict(q=torch.randn(b, h * k, height, width, generator=g, dtype=dtype),
             keys=torch.randn(b, u * k, height, width, generator=g, dtype=dtype) if rng.random() < 0.7 else None,
             v=torch.randn(b, u * dv, height, width, generator=g, dtype=dtype),
             table=torch.randn(k, u, *side, generator=g, dtype=dtype),
             shared=torch.randn(b, k, dv, generator=g, dtype=dtype) if rng.random() < 0.4 else None)
    spec = PL.Spec(form, k, u, dv, h, side[0], side[1], global_scope, stride)
    PL.set_backend(backend, strict=True)
    plan = PL.make_plan(spec, t['q'])
    return dict(t, stride=stride, count_include_pad=rng.random() < 0.3, key_norm=rng.choice(['softmax', 'l2', 'none']),
                global_scope=global_scope, form=form, backend=plan.backend, variant=plan.variant,
                compute_dtype=plan.compute_dtype, tiling=list(plan.tiling))


def _resize(x: torch.Tensor, dim: int, by: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = max(0, shape[dim] + by)
    return torch.randn(shape, dtype=x.dtype)


# (name, the argument the error must name (None: a valid call, equal to plain's), mutation)
MUTATIONS = [
    ('q rank 3', 'q', lambda a, r: a.update(q=a['q'].flatten(2))),
    ('q channels not h k', 'q', lambda a, r: a.update(q=_resize(a['q'], 1, 1))),
    ('q wider map than v', 'v', lambda a, r: a.update(q=_resize(a['q'], 3, 1))),
    ('v batch', 'v', lambda a, r: a.update(v=_resize(a['v'], 0, 1))),
    ('v height', 'v', lambda a, r: a.update(v=_resize(a['v'], 2, r.choice([-1, 1, 5])))),
    ('v channels not u V', 'v', lambda a, r: a.update(v=_resize(a['v'], 1, 1) if a['table'].shape[1] > 1 else
                                                      torch.randn(a['v'].shape[0], 0, *a['v'].shape[2:],
                                                                  dtype=a['v'].dtype))),
    ('table rank 3', 'table', lambda a, r: a.update(table=a['table'][0])),
    ('table even side', 'table', lambda a, r: a.update(table=_resize(a['table'], 2, 1))),
    ('table k', ('q', 'keys', 'shared'), lambda a, r: a.update(table=_resize(a['table'], 0, 1))),
    ('keys shape', 'keys', lambda a, r: a.update(keys=torch.randn(a['q'].shape[0], 1, *a['q'].shape[2:],
                                                                   dtype=a['q'].dtype) if a['keys'] is not None and
                                                 a['keys'].shape[1] != 1 else torch.randn(1, 5, 2, 2,
                                                                                           dtype=a['q'].dtype))),
    ('shared shape', 'shared', lambda a, r: a.update(shared=torch.randn(a['q'].shape[0], 1, 7, dtype=a['q'].dtype))),
    ('table in another dtype', 'table', lambda a, r: a.update(table=a['table'].half())),
    ('v float16', 'v', lambda a, r: a.update(v=a['v'].half())),
    ('q int64', 'q', lambda a, r: a.update(q=a['q'].long())),
    ('v not a tensor', 'v', lambda a, r: a.update(v=a['v'].tolist())),
    ('stride', 'stride', lambda a, r: a.update(stride=r.choice([0, -1, 3, 4]))),
    ('key_norm', 'key_norm', lambda a, r: a.update(key_norm=r.choice(['bogus', 'L2', '']))),
    ('form', 'form', lambda a, r: a.update(form=r.choice(['bogus', 'auto', 'einsum']))),
    ('backend', 'backend', lambda a, r: a.update(backend=r.choice(['bogus', 'plain', '', 'auto']))),
    ('variant', 'variant', lambda a, r: a.update(variant='patched' if a['stride'] == 1 else 'sideways')),
    ('plan compute dtype', 'plan', lambda a, r: a.update(compute_dtype=torch.float16)),
    ('plan tiling', 'plan', lambda a, r: a.update(tiling=a['tiling'] + [7])),
    ('global table too small', 'max_size', lambda a, r: a.update(
        global_scope=True, table=torch.randn(*a['table'].shape[:2], 1, 1, dtype=a['table'].dtype))),
    # valid calls: the result equals the plain ops'
    ('non-contiguous maps', None, lambda a, r: a.update(
        q=a['q'].transpose(2, 3).contiguous().transpose(2, 3), v=a['v'][:, torch.arange(a['v'].shape[1]).flip(0)])),
    ('empty batch', None, lambda a, r: a.update(**{n: (None if a[n] is None else a[n][:0])
                                                   for n in ('q', 'keys', 'v', 'shared')})),
    ('NaN in q', None, lambda a, r: a['q'].view(-1)[r.randrange(a['q'].numel())].fill_(float('nan'))),
    ('Inf in v', None, lambda a, r: a['v'].view(-1)[r.randrange(a['v'].numel())].fill_(float('inf'))),
    ('unchanged', None, lambda a, r: None),
]
# the backward operator's own arguments (the forward's consistent)
BACKWARD_MUTATIONS = [
    ('gy smaller', 'gy', lambda a, r: a.update(gy=a['gy'][:, :, :1, :1].contiguous())),
    ('gy larger', 'gy', lambda a, r: a.update(gy=_resize(a['gy'], 2, 7))),
    ('gy in another dtype', 'gy', lambda a, r: a.update(gy=a['gy'].half())),
    ('content shape', 'content', lambda a, r: a.update(content=torch.randn(3, 1, 2, dtype=a['q'].dtype))),
    ('kn shape', 'kn', lambda a, r: a.update(kn=torch.randn(5, dtype=a['q'].dtype))),
    ('unchanged', None, lambda a, r: None),
]


# the CPU kernel's entry points called directly (a wrong call the operator never makes: its own TORCH_CHECKs)
KERNEL_MUTATIONS = [
    ('q rank 4', 'q', lambda a, r: a.update(q=a['q'][:, 0])),
    ('q map not v at the step', 'q', lambda a, r: a.update(q=_resize(a['q'], 4, 1))),
    ('v batch', 'v', lambda a, r: a.update(v=_resize(a['v'], 0, 1))),
    ('v channels not u V', 'v', lambda a, r: a.update(v=_resize(a['v'], 1, 1) if a['table'].shape[1] > 1 else
                                                      _resize(a['v'], 1, -a['v'].shape[1]))),
    ('table c', 'table', lambda a, r: a.update(table=_resize(a['table'], 0, 1))),
    ('table even side', 'table', lambda a, r: a.update(table=_resize(a['table'], 3, 1))),
    ('content shape', 'content', lambda a, r: a.update(content=torch.randn(1, 2, 3, dtype=a['q'].dtype))),
    ('gy smaller', 'gy', lambda a, r: a.update(gy=a['gy'][:, :1, :1].contiguous())),
    ('gy larger', 'gy', lambda a, r: a.update(gy=_resize(a['gy'], 3, 9))),
    ('table in another dtype', 'table', lambda a, r: a.update(table=a['table'].half())),
    ('step 3', 'step', lambda a, r: a.update(step=3)),
    ('unchanged', None, lambda a, r: None),
]


# the CPU kernel's whole-call entry points (``layer_forward``, ``layer_backward``: stride 1, softmax keys), called
# directly
WHOLE_MUTATIONS = [
    ('q rank 5', 'q', lambda a, r: a.update(q=a['q'].unsqueeze(0))),
    ('q channels not h k', 'q', lambda a, r: a.update(q=_resize(a['q'], 1, 1))),
    ('q map not v', 'v', lambda a, r: a.update(q=_resize(a['q'], 3, 1))),
    ('keys channels', 'keys', lambda a, r: a.update(keys=_resize(a['keys'], 1, 1) if a['keys'] is not None else
                                                    torch.randn(1, 1, 1, 1, dtype=a['q'].dtype))),
    ('keys map', 'keys', lambda a, r: a.update(keys=_resize(a['keys'], 2, 1) if a['keys'] is not None else
                                               torch.randn(1, 1, 1, 1, dtype=a['q'].dtype))),
    ('v batch', 'v', lambda a, r: a.update(v=_resize(a['v'], 0, 1))),
    ('table even side', 'table', lambda a, r: a.update(table=_resize(a['table'], 3, 1))),
    ('table in another dtype', 'table', lambda a, r: a.update(table=a['table'].float())),
    ('key_norm', 'key_norm', lambda a, r: a.update(key_norm=r.choice(['bogus', 'L2', '']))),
    ('shared shape', 'shared', lambda a, r: a.update(shared=torch.randn(a['q'].shape[0], 1, 7, dtype=a['q'].dtype))),
    ('gy channels', 'gy', lambda a, r: a.update(gy=_resize(a['gy'], 1, 1))),
    ('content shape', 'content', lambda a, r: a.update(content=torch.randn(3, 1, 2, dtype=a['q'].dtype))),
    ('kn shape', 'kn', lambda a, r: a.update(kn=torch.randn(5, dtype=a['q'].dtype))),
    ('non-contiguous maps', None, lambda a, r: a.update(
        q=a['q'].transpose(2, 3).contiguous().transpose(2, 3), v=a['v'][:, torch.arange(a['v'].shape[1]).flip(0)])),
    ('empty batch', None, lambda a, r: a.update(**{n: (None if a[n] is None else a[n][:0])
                                                   for n in ('q', 'keys', 'v', 'shared', 'gy')})),
    ('unchanged', None, lambda a, r: None),
]


def whole_case(rng: random.Random, mutation: str):
    """A direct call of the CPU kernel's ``layer_forward`` and ``layer_backward`` (float64, each key norm; what the
    forward kept, or nothing), its verdict: an error naming the argument, or the plain ops' output and gradients."""
    module = cpu_kernel.load()
    b, h, k, u, dv = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([2, 3]), rng.choice([1, 2]), rng.choice([1, 3])
    height, width, side = rng.randint(1, 7), rng.randint(1, 7), rng.choice([1, 3, 5, 9])
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    a = dict(q=torch.randn(b, h * k, height, width, generator=g, dtype=torch.float64),
             keys=torch.randn(b, u * k, height, width, generator=g, dtype=torch.float64) if rng.random() < 0.7
             else None,
             v=torch.randn(b, u * dv, height, width, generator=g, dtype=torch.float64),
             table=torch.randn(k, u, side, side, generator=g, dtype=torch.float64),
             shared=torch.randn(b, k, dv, generator=g, dtype=torch.float64) if rng.random() < 0.4 else None,
             gy=torch.randn(b, h * dv, height, width, generator=g, dtype=torch.float64), form='tiled', stride=1,
             count_include_pad=False, key_norm=rng.choice(['softmax', 'l2', 'none']), global_scope=False)
    keep = rng.random() < 0.6
    name, expect, mutate = next(m for m in WHOLE_MUTATIONS if m[0] == mutation)
    mutate(a, rng)
    maps = [a[n] for n in ('q', 'keys', 'v', 'table', 'shared')]
    try:
        runs = []
        for _ in range(2):
            y, content, kn = module.layer_forward(*maps, a['key_norm'])
            if not keep:
                content, kn = None, None
            content, kn = a.get('content', content), a.get('kn', kn)
            runs.append([y] + [x for x in module.layer_backward(a['gy'], *maps, content, kn, a['key_norm'])
                               if x is not None and x.numel()])
    except (ValueError, TypeError) as e:
        return dict(verdict='error', type=type(e).__name__, message=str(e)[:400], expect=expect)
    except Exception as e:
        return dict(verdict='other error', type=type(e).__name__, message=str(e)[:400], expect=expect)
    out = [torch.cat([x.reshape(-1) for x in run]) for run in runs]
    if not _same(out[0], out[1]):
        return dict(verdict='nondeterministic', expect=expect)
    leaves = [None if x is None else x.detach().requires_grad_() for x in maps]
    present = [x for x in leaves if x is not None]
    with torch.enable_grad():
        y = _plain(dict(a, **dict(zip(('q', 'keys', 'v', 'table', 'shared'), leaves))))
        grads = torch.autograd.grad(y, present, a['gy'], allow_unused=True) if y.numel() else [None] * len(present)
    want = torch.cat([y.detach().reshape(-1)] + [(torch.zeros_like(x) if g is None else g).reshape(-1)
                                                 for x, g in zip(present, grads) if x.numel()])
    why = _check(out[0], want, True)
    return dict(verdict='result' if not why else 'wrong result', why=why, expect=expect)


def kernel_case(rng: random.Random, mutation: str, backend: str):
    """A direct call of the kernels' forward and backward (the CPU kernel's, bfloat16's where built in bfloat16;
    or the Triton wrappers'), its verdict."""
    if backend == 'cpu_kernel':
        module = cpu_kernel.load()
        bf16 = rng.random() < 0.3 and bool(module.bf16)
        forward, backward = ((module.tiled_forward_bf16, module.tiled_backward_bf16) if bf16 else
                             (module.tiled_forward, module.tiled_backward))
        dtype = torch.bfloat16 if bf16 else torch.float64
    else:
        from timm_lambda.layers.position_lambda import tiled_triton
        tc = backend == 'triton_tc'
        dtype = torch.float32 if tc else torch.float64

        def forward(q, v, table, content, step):
            return tiled_triton.forward(q, v, table, step, content, tensor_cores=tc)

        def backward(gy, q, v, table, content, step):
            return tiled_triton.backward(gy, q, v, table, step, content, tensor_cores=tc)
    b, h, c, u, dv, step = rng.choice([1, 2]), rng.choice([1, 3]), rng.choice([2, 5]), rng.choice([1, 2]), \
        rng.choice([1, 17]), rng.choice([1, 2])
    height, width, side = rng.randint(1, 9), rng.randint(1, 9), rng.choice([1, 3, 5])
    ho, wo = -(-height // step), -(-width // step)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    a = dict(q=torch.randn(b, h, c, ho, wo, generator=g).to(dtype), v=torch.randn(b, u * dv, height, width,
                                                                                 generator=g).to(dtype),
             table=torch.randn(c, u, side, side, generator=g).to(dtype),
             content=torch.randn(b, c, dv, generator=g).to(dtype) if rng.random() < 0.5 else None, step=step,
             gy=torch.randn(b, h * dv, ho, wo, generator=g).to(dtype))
    name, expect, mutate = next(m for m in KERNEL_MUTATIONS if m[0] == mutation)
    mutate(a, rng)
    try:
        out = [torch.cat([forward(a['q'], a['v'], a['table'], a['content'], a['step']).reshape(-1)] +
                         [x.reshape(-1).to(dtype) for x in backward(a['gy'], a['q'], a['v'], a['table'], a['content'],
                                                                    a['step'])]) for _ in range(2)]
    except (ValueError, TypeError) as e:
        return dict(verdict='error', type=type(e).__name__, message=str(e)[:400], expect=expect)
    except Exception as e:
        return dict(verdict='other error', type=type(e).__name__, message=str(e)[:400], expect=expect)
    if not _same(out[0], out[1]):
        return dict(verdict='nondeterministic', expect=expect)
    if not torch.isfinite(out[0].double()).all():
        return dict(verdict='wrong result', why='non-finite result from finite inputs', expect=expect)
    return dict(verdict='result', why='', expect=expect)  # (values: tests/test_position_lambda.py)


def _plain(a: dict) -> torch.Tensor:
    """The plain ops' output of a consistent call."""
    q, table = a['q'], a['table']
    k, u = table.shape[0], table.shape[1]
    b, height, width = q.shape[0], q.shape[2], q.shape[3]
    n = height * width
    keys = a['keys']
    return lambdas_plain(q.reshape(b, q.shape[1] // k, k, n), None if keys is None else keys.reshape(b, u, k, n),
                         a['v'].reshape(b, u, a['v'].shape[1] // u, n), table, a['shared'], height, width, a['form'],
                         a['stride'], a['count_include_pad'], a['key_norm'], a['global_scope'], None)


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and bool(torch.equal(torch.nan_to_num(x, 7.0, 8.0, 9.0),
                                                   torch.nan_to_num(y, 7.0, 8.0, 9.0)))


def _check(got: torch.Tensor, want: torch.Tensor, finite_inputs: bool) -> str:
    """'' where ``got`` equals ``want`` (where ``want`` is finite; all finite from finite inputs), else why not."""
    if got.shape != want.shape:
        return f'shape {list(got.shape)} against {list(want.shape)}'
    if finite_inputs and not torch.isfinite(got).all():
        return 'non-finite result from finite inputs'
    ok = torch.isfinite(want)
    tol = 1e-9 if got.dtype == torch.float64 else 1e-4
    scale = max(1.0, want[ok].abs().max().item()) if ok.any() else 1.0
    if not torch.allclose(got[ok], want[ok], rtol=tol, atol=tol * scale):
        return f'off the plain ops by {(got[ok] - want[ok]).abs().max().item():.3g}'
    return ''


def run_case(case: dict) -> dict:
    """In the child: the call, then its verdict."""
    rng = random.Random(case['seed'])
    direction = case['direction']
    if direction == 'kernel':
        return kernel_case(rng, case['mutation'], case['backend'])
    if direction == 'whole':
        return whole_case(rng, case['mutation'])
    a = base(rng, case['backend'])
    mutations = MUTATIONS if direction == 'forward' else BACKWARD_MUTATIONS
    name, expect, mutate = next(m for m in mutations if m[0] == case['mutation'])
    if direction == 'backward':  # the forward's outputs first, from the consistent arguments
        y, content, kn = OP(*[a[n] for n in NAMES])
        a.update(gy=torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(case['seed'])),
                 content=content, kn=kn)
    mutate(a, rng)
    finite = all(x is None or not isinstance(x, torch.Tensor) or not x.is_floating_point() or
                 bool(torch.isfinite(x).all()) for x in a.values())
    try:
        if direction == 'forward':
            out = [OP(*[a[n] for n in NAMES])[0] for _ in range(2)]
            want = [_plain(a)]
        else:
            args = [a['gy']] + [a[n] for n in NAMES[:5]] + [a['content'], a['kn']] + [a[n] for n in NAMES[5:]]
            got = [OP_BACKWARD(*args) for _ in range(2)]
            out = [torch.cat([g.reshape(-1) for g in run]) for run in got]
            leaves = [None if a[n] is None else a[n].detach().requires_grad_() for n in NAMES[:5]]
            present = [x for x in leaves if x is not None]
            with torch.enable_grad():
                y = _plain(dict(a, **dict(zip(NAMES[:5], leaves))))
            grads = torch.autograd.grad(y, present, a['gy'], allow_unused=True)
            want = [torch.cat([(torch.zeros_like(x) if g is None else g).reshape(-1) for x, g in zip(present, grads)])]
    except (ValueError, TypeError) as e:
        return dict(verdict='error', type=type(e).__name__, message=str(e)[:400], expect=expect)
    except RuntimeError as e:  # torch's own check of the schema's types names the argument too
        if 'Expected a value of type' in str(e) and 'for argument' in str(e):
            return dict(verdict='error', type=type(e).__name__, message=str(e)[:400], expect=expect)
        return dict(verdict='other error', type=type(e).__name__, message=str(e)[:400], expect=expect)
    except Exception as e:  # any other error type is a failure of the boundary
        return dict(verdict='other error', type=type(e).__name__, message=str(e)[:400], expect=expect)
    if not _same(out[0], out[1]):
        return dict(verdict='nondeterministic', expect=expect)
    why = _check(out[0], want[0].to(out[0].dtype), finite)
    return dict(verdict='result' if not why else 'wrong result', why=why, expect=expect)


def in_child(case: dict) -> dict:
    """``run_case`` in a forked child (its verdict through a pipe); a signal or a hang is a crash."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        signal.alarm(120)
        try:
            line = json.dumps(run_case(case))
        except BaseException as e:  # (a failure of this script itself)
            line = json.dumps(dict(verdict='driver error', type=type(e).__name__, message=str(e)[:400]))
        os.write(write, line.encode())
        os.close(write)
        os._exit(0)
    os.close(write)
    data = b''
    while True:
        chunk = os.read(read, 65536)
        if not chunk:
            break
        data += chunk
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) or not data:
        return dict(verdict='crash', signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                    status=status)
    return json.loads(data)


def cases(backends, n: int, seed: int):
    """``n`` cases a backend, the mutations in turn (every one at least once), forward and backward."""
    rng = random.Random(seed)
    out = []
    for backend in backends:
        names = [('forward', m[0]) for m in MUTATIONS] + [('backward', m[0]) for m in BACKWARD_MUTATIONS]
        if backend != 'gemm':  # (the kernels' own entry points)
            names += [('kernel', m[0]) for m in KERNEL_MUTATIONS]
        if backend == 'cpu_kernel':
            names += [('whole', m[0]) for m in WHOLE_MUTATIONS]
        for i in range(n):
            direction, mutation = names[i % len(names)]
            out.append(dict(backend=backend, direction=direction, mutation=mutation, seed=rng.randrange(1 << 30)))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument('backends', nargs='+')
    p.add_argument('--cases', type=int, default=120, help='cases a backend')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--asan-build', default=None)
    args = p.parse_args()
    if args.asan_build:
        from torch.utils import cpp_extension
        sources = cpu_kernel._SOURCES  # (all of the kernel's: the bindings name the BRGEMM file's entry points)
        flags = ['-O1', '-g', '-fno-omit-frame-pointer', '-fsanitize=address', '-march=native', '-fopenmp']
        module = cpp_extension.load('timm_lambda_tiled_cpu_asan', sources, extra_cflags=flags,
                                    extra_ldflags=['-fsanitize=address', '-fopenmp'], build_directory=args.asan_build)
        cpu_kernel.serving(module).__enter__()  # (for the whole run)
        print(f'# the CPU kernel built with AddressSanitizer serves: {module.__file__}', flush=True)
    todo = cases(args.backends, args.cases, args.seed)
    for case in todo:
        print(json.dumps(dict(case, **in_child(case))), flush=True)
    print(f'done {len(todo)}', flush=True)


if __name__ == '__main__':
    sys.exit(main())
