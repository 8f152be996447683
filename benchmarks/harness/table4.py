"""LambdaNetworks Table 4 on this machine: lambda layers against global, axial and local self-attention in one
ResNet-50 frame (``benchmarks/benchmark_table4.py`` is the command line; it writes docs/table4.md and docs/table4.png).

* :data:`TABLE4_ROWS`, :func:`analytic_memory_gib`: Table 4's rows in one ResNet-50 frame and the memory its
  complexity column gives in the paper's convention, reconstructed from its figures: float32, batch 128, 8
  heads, |k| = 16, every one of the 16 blocks at its stage's output resolution at 224 px (56, 28, 14, 7), in
  GiB (2^30 bytes). It reproduces the paper's 120 / 4.8 / 1.9 / 0.95 / 0.63: global attention maps
  ``b h n^2`` per layer 122.8, axial ``b h n (H + W)`` 4.8, lambda embeddings ``k n^2`` per layer 1.92 (0.96
  with |k| = 8), shared embeddings one ``k n^2`` table per resolution 0.625.
* :func:`run_table4`, :func:`markdown`, :func:`plot`: the benchmark. Peak memory of one training step
  (forward, cross-entropy, backward) is measured with :func:`harness.measure.peak_step_bytes`
  (the CPU allocator's events) where it fits ``max_gib``; a row whose estimate does not fit is not run and shows the
  analytic figure instead, marked as such. Times are medians of interleaved training steps (and inference
  forwards), reported as ratios to the lambda layer row, next to the paper's ratio of inference throughputs.
"""
from typing import Optional, Sequence

import timm
import torch
import torch.nn.functional as F

from timm_lambda.models._blocks import stage_sizes
from timm_lambda.paper import TABLE4

from .measure import interleaved_times, machine, median, peak_step_bytes

__all__ = ['TABLE4_ROWS', 'analytic_memory_gib', 'run_table4', 'markdown', 'markdown_document', 'plot']

# LambdaNetworks Table 4 layer -> (model, kwargs, memory kind for analytic_memory_gib).
TABLE4_ROWS = {
    'Global self-attention': ('resnet50_global_attn', {}, 'global'),
    'Axial self-attention': ('resnet50_axial_attn', {}, 'axial'),
    'Local self-attention (7x7)': ('resnet50_local_attn7', {}, 'local'),
    'Lambda layer': ('resnet50_lambda', {}, 'lambda'),
    'Lambda layer (|k|=8)': ('resnet50_lambda_k8', {}, 'lambda_k8'),
    'Lambda layer (shared embeddings)': ('resnet50_lambda_shared', {}, 'lambda_shared'),
    'Lambda convolution (7x7)': ('resnet50_lambda_conv7', {}, 'lambda_conv'),
}
REFERENCE = 'Lambda layer'  # time ratios are relative to this row


def analytic_memory_gib(kind: str, batch: int = 128, img_size: int = 224, heads: int = 8, dim_k: int = 16,
                        kernel: int = 7, depths: Sequence[int] = (3, 4, 6, 3), bytes_per: int = 4) -> float:
    """Memory the Table 4 complexity of ``kind`` gives in the paper's convention (module docstring), GiB.

    ``kind``: 'global' (attention maps b h n^2 per layer), 'axial' (b h n (H + W)), 'local' (b h n m, m =
    kernel^2), 'lambda' / 'lambda_k8' (position embeddings k n^2 per layer; |k| = 8 for the latter),
    'lambda_shared' (one k n^2 table per resolution), 'lambda_conv' (the paper's Theta(l k n m)).
    """
    total = 0
    for depth, (h, w) in zip(depths, stage_sizes((img_size, img_size))):
        n = h * w
        per_layer = {
            'global': batch * heads * n * n,
            'axial': batch * heads * n * (h + w),
            'local': batch * heads * n * kernel * kernel,
            'lambda': dim_k * n * n,
            'lambda_k8': 8 * n * n,
            'lambda_shared': 0,
            'lambda_conv': dim_k * n * kernel * kernel,
        }
        if kind not in per_layer:
            raise ValueError(f'kind must be one of {sorted(per_layer)}, got {kind!r}')
        total += depth * per_layer[kind] + (dim_k * n * n if kind == 'lambda_shared' else 0)
    return total * bytes_per / 2 ** 30


def _estimate_step_gib(kind: str, batch: int, img_size: int) -> float:
    """A generous estimate of a training step's peak memory, to skip rows that cannot fit: three copies of
    the analytic maps (logits, saved softmax, gradient) plus ~0.2 GiB per image for the ResNet-50 frame."""
    maps = analytic_memory_gib(kind, batch, img_size) if kind in ('global', 'axial', 'local') else 0.0
    return 3 * maps + 0.2 * batch * (img_size / 224) ** 2


def run_table4(batch: int = 2, img_size: int = 224, repeats: int = 3, warmup: int = 1, max_gib: float = 8.0,
               infer: bool = True, rows: Optional[Sequence[str]] = None, max_seconds: Optional[float] = None,
               model_kwargs: Optional[dict] = None, log=print, timing: bool = True) -> dict:
    """Measure every Table 4 row (or ``rows``, layer names) at ``img_size`` and ``batch`` on the CPU.

    ``model_kwargs`` go to every ``create_model`` (e.g. ``layers=(1, 1, 1, 1)`` for a quick check).
    ``timing=False``: peak memory only (times and ratios None).

    Returns dict(batch, img_size, machine, load_before, load_after, rows=[...]) with, per row: layer,
    model, complexity, paper_gb, paper_throughput, paper_top1, analytic_gib (batch 128), params_m,
    measured_gib (None if skipped), estimate_gib, train_s, infer_s (None if skipped), and the ratios
    train_ratio, infer_ratio, paper_ratio to the lambda layer row.
    """
    names = list(TABLE4_ROWS) if rows is None else list(rows)
    unknown = [r for r in names if r not in TABLE4_ROWS]
    if unknown:
        raise ValueError(f'rows must be Table 4 layers {list(TABLE4_ROWS)}, got {unknown}')
    if REFERENCE not in names:
        names.append(REFERENCE)
    paper = {layer: (cx, gb, thr, top1) for layer, cx, gb, thr, top1 in TABLE4}
    load_before = machine()
    x = torch.randn(batch, 3, img_size, img_size)
    y = torch.randint(0, 1000, (batch,))
    results, models, train_steps, infer_steps = [], {}, {}, {}
    for layer in names:
        name, kwargs, kind = TABLE4_ROWS[layer]
        complexity, paper_gb, paper_thr, paper_top1 = paper[layer]
        torch.manual_seed(0)
        model = timm.create_model(name, **kwargs, **(model_kwargs or {})).train()
        estimate = _estimate_step_gib(kind, batch, img_size)
        row = dict(layer=layer, model=name, complexity=complexity, paper_gb=paper_gb, paper_throughput=paper_thr,
                   paper_top1=paper_top1, analytic_gib=analytic_memory_gib(kind), estimate_gib=estimate,
                   params_m=sum(p.numel() for p in model.parameters()) / 1e6, measured_gib=None, train_s=None,
                   infer_s=None)
        results.append(row)
        if estimate > max_gib:
            log(f'{layer}: estimated {estimate:.1f} GiB > max_gib={max_gib}: not run')
            continue

        def train(m=model):
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(x).float(), y).backward()

        def forward(m=model):
            with torch.no_grad():
                m(x)

        log(f'{layer}: measuring peak memory of a training step ({name})')
        row['measured_gib'] = peak_step_bytes(train) / 2 ** 30
        if timing:
            models[layer], train_steps[layer], infer_steps[layer] = model, train, forward
    times = {}
    if timing:
        log(f'timing {len(train_steps)} training steps, interleaved, {repeats} rounds')
        times = interleaved_times(train_steps, repeats=repeats, warmup=warmup, max_seconds=max_seconds)
    if infer and timing:
        for m in models.values():
            m.eval()
        log('timing inference')
        infer_times = interleaved_times(infer_steps, repeats=repeats, warmup=warmup, max_seconds=max_seconds)
    for row in results:
        if row['layer'] in times:
            row['train_s'] = median(times[row['layer']])
            row['infer_s'] = median(infer_times[row['layer']]) if infer and timing else None
    ref = next(r for r in results if r['layer'] == REFERENCE)
    for row in results:
        row['train_ratio'] = row['train_s'] / ref['train_s'] if row['train_s'] and ref['train_s'] else None
        row['infer_ratio'] = row['infer_s'] / ref['infer_s'] if row['infer_s'] and ref['infer_s'] else None
        row['paper_ratio'] = ref['paper_throughput'] / row['paper_throughput'] if row['paper_throughput'] else None
    return dict(batch=batch, img_size=img_size, repeats=repeats, max_gib=max_gib, machine=load_before,
                load_after=machine(), rows=results)


_SHORT = {'Global self-attention': 'global\nattention', 'Axial self-attention': 'axial\nattention',
          'Local self-attention (7x7)': 'local 7x7\nattention', 'Lambda layer': 'lambda',
          'Lambda layer (|k|=8)': 'lambda\n|k|=8', 'Lambda layer (shared embeddings)': 'lambda\nshared emb.',
          'Lambda convolution (7x7)': 'lambda\nconv 7x7'}


def _fmt(value, spec: str, none: str = '-') -> str:
    return none if value is None else format(value, spec)


def markdown(result: dict) -> str:
    """Table 4 side by side: the paper's figures and ours (see the module docstring for the conventions)."""
    b, size = result['batch'], result['img_size']
    lines = [
        '| Layer | model | complexity | memory, paper (GB) | memory, analytic (GiB) | measured peak (GiB) '
        '| time ratio, paper | ours, training | ours, inference | train step (s) | params (M) | top-1, paper |',
        '|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|',
    ]
    for r in result['rows']:
        if r['measured_gib'] is None:
            measured = f"not run: estimate {r['estimate_gib']:.1f} GiB > {result['max_gib']:g} (analytic above)"
        else:
            measured = f"{r['measured_gib']:.2f}"
        paper_ratio = 'OOM' if r['paper_throughput'] is None else f"{r['paper_ratio']:.2f}"
        lines.append(
            f"| {r['layer'].replace('|', chr(92) + '|')} | `{r['model']}` | {r['complexity']} "
            f"| {_fmt(r['paper_gb'], 'g')} "
            f"| {r['analytic_gib']:.3g} | {measured} | {paper_ratio} | {_fmt(r['train_ratio'], '.2f')} "
            f"| {_fmt(r['infer_ratio'], '.2f')} | {_fmt(r['train_s'], '.2f')} | {r['params_m']:.1f} "
            f"| {_fmt(r['paper_top1'], 'g', 'OOM')} |")
    lines += [
        '',
        f"{size}x{size} px, batch {b}, float32, CPU; {result['repeats']} interleaved rounds, medians. "
        f"Machine before: {result['machine']}; "
        f"after: load average {result['load_after'].rsplit('load average ', 1)[-1]}.",
    ]
    return '\n'.join(lines)


def markdown_document(result: dict, command: str) -> str:
    """docs/table4.md: the table with what its columns mean."""
    b, side = result['batch'], result['img_size']
    return f"""# LambdaNetworks Table 4 on CPU

Generated by `{command}` (benchmarks/harness/table4.py). Every row is a vanilla ResNet-50 (timm's ResNet
frame) whose 16 bottleneck 3x3 convolutions are all replaced by the layer, at {side}x{side} px.

{markdown(result)}

- **memory, paper**: LambdaNetworks Table 4 (attention maps or position embeddings, float32, batch 128; "-"
  where the paper gives none).
- **memory, analytic**: the figure the complexity column gives in the paper's convention, which we
  reconstructed from its numbers: batch 128, float32, 8 heads, |k| = 16, every layer at its stage's output
  resolution at 224 px (56, 28, 14, 7 px), GiB. It reproduces 120 / 4.8 / 1.9 / 0.95 / 0.63 (global
  attention b h n^2 per layer; axial b h n (H + W); lambda k n^2 per layer; shared: one k n^2 table per
  resolution). Local attention and the lambda convolution are our evaluation of the same formulas.
- **measured peak**: the peak memory of a training step (forward, cross-entropy and backward) at batch {b},
  the most memory the CPU allocator held at once for blocks allocated during the step (activations, attention maps,
  temporaries inside every operator, gradients; parameters and the input excluded; read from the profiler's
  allocator events, benchmarks/harness/measure.py). It includes the whole network's
  activations, so it is not the paper's quantity; a row estimated above `--max-gib` is not run (the paper's
  OOM) and only its analytic figure stands.
- **time ratio, paper**: the lambda layer's inference throughput divided by the row's (8 TPUv3 cores).
- **ours, training / inference**: median time per training step at batch {b} (and per inference forward,
  `no_grad`) divided by the lambda layer's, interleaved in one process; CPU float32, so only the ratios compare,
  and only loosely (CPU kernels, not TPU ones; the lambda layer rows pick their implementation per size,
  `form='auto'`, except the lambda convolution row, `form='conv'`). The load average in the footer says how busy
  the 2 cores were.
"""


def plot(result: dict, path: str) -> None:
    """PNG: memory (paper vs analytic at batch 128, measured at the run's batch) and time ratios."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    rows = result['rows']
    labels = [_SHORT.get(r['layer'], r['layer']) for r in rows]
    idx = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    w = 0.4
    ax = axes[0]
    ax.bar([i - w / 2 for i in idx], [r['paper_gb'] or 0 for r in rows], w, label='paper (GB)')
    ax.bar([i + w / 2 for i in idx], [r['analytic_gib'] for r in rows], w, label='analytic, paper convention (GiB)')
    ax.set_yscale('log')
    ax.set_title('Memory of attention maps / embeddings, batch 128, 224 px')
    for i, r in enumerate(rows):
        if r['paper_gb'] is None:
            ax.text(i - w / 2, 0.05, 'paper: -', ha='center', fontsize=7, rotation=90)
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar(list(idx), [r['measured_gib'] or 0 for r in rows], 0.6, color='tab:green')
    for i, r in enumerate(rows):
        if r['measured_gib'] is None:
            ax.text(i, 0.01, 'not run:\ntoo large', ha='center', fontsize=8)
    ax.set_title(f"Measured peak memory of a training step (GiB), batch {result['batch']}")
    ax = axes[2]
    ax.bar([i - w / 2 for i in idx], [r['paper_ratio'] or 0 for r in rows], w, label='paper: inference (TPUv3)')
    ax.bar([i + w / 2 for i in idx], [r['train_ratio'] or 0 for r in rows], w, label='ours: training step (CPU)')
    if any(r['infer_ratio'] for r in rows):
        ax.plot(list(idx), [r['infer_ratio'] or float('nan') for r in rows], 'k_', markersize=20,
                label='ours: inference (CPU)')
    for i, r in enumerate(rows):
        if r['paper_throughput'] is None:
            ax.text(i - w / 2, 0.05, 'paper: OOM', ha='center', fontsize=7, rotation=90)
    ax.axhline(1.0, color='grey', lw=0.8)
    ax.set_title('Time relative to the lambda layer (lower is faster)')
    ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(idx))
        ax.set_xticklabels(labels, fontsize=8)
    fig.suptitle(f"LambdaNetworks Table 4 in a ResNet-50 at {result['img_size']} px: {result['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
