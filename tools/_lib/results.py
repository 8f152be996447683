"""The result tables of README.md and docs/, rendered from the committed JSON in docs/results/ (issue 59).

A block is registered in :data:`BLOCKS`: its page, its name and a renderer. A renderer takes the newest result of
one *kind* (:func:`newest`: by the JSON's own ``date``; a result's kind is read from its content by :func:`kind_of`,
so a new run of the same command supersedes the old one without an edit here) and returns the table; the block's
opening line names the JSON it came from (``<!-- generated:NAME from docs/results/X.json -->``) and a caption under
it names the JSON, its commit (``not recorded`` where the run did not record one: never guessed), date, machine and
instruction set, and the command that reproduces it. ``python tools/generate.py`` writes the blocks,
``--check`` (and tests/test_generated.py) fails where one is stale or its JSON is gone.

A JSON whose file name holds ``before`` or its own commit (``detection_shapes_269e94e.json``) is a run of named
earlier code kept for comparison: never the newest of its kind. A program that writes one JSON of parts
(benchmarks/cpu_table.py) contributes each part as a result of its own, named ``file.json#part``.

To add a block for a new JSON: ``python tools/generate.py --kinds`` prints each result's kind (a branch of
:func:`kind_of` where its content is new); a renderer (a function of a :class:`Result` returning markdown lines, or
an existing one); one line of :data:`BLOCKS`, ``'name': of(kind, renderer)``; the two marker lines
``<!-- generated:name -->`` and ``<!-- /generated:name -->`` on the page; then ``python tools/generate.py``.
"""
import json
import re
import statistics
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / 'docs' / 'results'
NOT_RECORDED = 'not recorded'
# the instruction sets of the CPUs that earlier results ran on, where the JSON did not record them: hardware facts
# (the kernel was built with -march=native on each, as docs/benchmarks.md recorded at the time)
CPU_ISA = {
    'AMD EPYC (family 25, model 17)': 'AVX-512 with AVX-512 BF16 (Zen 4), the kernel built -march=native',
    'Intel(R) Xeon(R) Processor (family 6, model 167)': 'AVX-512 with AVX-512 BF16 and AMX, the kernel built '
                                                         '-march=native',
    'AMD EPYC (family 26, model 2)': 'AVX-512 with AVX-512 BF16 (Zen 5), the kernel built -march=native',
}
# the README's CPU table's main file (one CPU, its parts also holding the libraries to smaller CPUs' instruction
# sets); cpu_table_<vendor>.json: the same program on another CPU, its parts kinds of their own (never a main block's)
CPU_TABLE = 'cpu_table'
KERNEL_ISA = {'avx512_bf16': 'AVX-512 BF16', 'avx512': 'AVX-512', 'avx2': 'AVX2 + FMA', 'neon': 'NEON',
              'none': 'SSE'}

__all__ = ['Result', 'results', 'kind_of', 'newest', 'caption', 'BLOCKS', 'render']


@dataclass(frozen=True)
class Result:
    """One result: ``name`` (``file.json`` or ``file.json#part``), its data and its provenance record (the part's
    record, or the file's, or the file's first row where it is a list of rows)."""
    name: str
    data: object
    record: dict

    @property
    def file(self) -> str:
        return self.name.split('#')[0]

    def get(self, key: str, default=None):
        value = self.record.get(key)
        return default if value in (None, '') else value


# a block's renderer: the page -> (the results it shows, its lines)
Renderer = Callable[[str], Tuple[List['Result'], List[str]]]


def _record(data) -> dict:
    return data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else (
        data if isinstance(data, dict) else {})


@lru_cache(maxsize=None)
def _load(name: str):
    with open(RESULTS / name) as f:
        return json.load(f)


def results() -> List[Result]:
    """Every committed result, the parts of a JSON of parts each as its own."""
    out = []
    for path in sorted(RESULTS.glob('*.json')):
        data = _load(path.name)
        out.append(Result(path.name, data, _record(data)))
        if isinstance(data, dict) and isinstance(data.get('parts'), dict):
            for part, record in data['parts'].items():
                out.append(Result(f'{path.name}#{part}', record['result'], dict(
                    record, machine=data.get('machine'), cpu=data.get('cpu'))))
    return out


def baseline(result: Result) -> bool:
    """A run of named earlier code, kept for comparison: ``before`` or its own commit in its file name."""
    if isinstance(result.data, dict) and 'before_after.py' in result.data.get('command', ''):
        return False  # (a comparison of earlier code with its commit: its own kind)
    commit = str(result.get('commit', ''))
    return 'before' in result.file or (len(commit) >= 7 and commit[:7] in result.file)


def _device(result: Result) -> str:
    return 'cuda' if 'NVIDIA' in json.dumps(result.get('machine', '')) else 'cpu'


def kind_of(result: Result) -> Optional[Tuple]:
    """What a result measured (its command, settings and device), read from its content: results of one kind are
    runs of the same measurement. None: not a kind any block shows. A part of another CPU's table
    (``cpu_table_amd.json#c4``) ends in ``('table', 'cpu_table_amd')``."""
    kind, stem = _kind_of(result), result.file.split('.')[0]
    if kind is not None and '#' in result.name and stem != CPU_TABLE:
        kind += (('table', stem),)
    return kind


def _kind_of(result: Result) -> Optional[Tuple]:
    data, r = result.data, _record(result.data)  # the content; a part's own record holds its environment
    if isinstance(data, dict) and 'parts' in data:
        return ('parts', result.file.split('.')[0])
    if isinstance(data, dict) and 'before_after.py' in data.get('command', ''):  # runs before and after a change
        return ('before_after', data['program'], _vendor(data))
    held = tuple(sorted(result.record.get('env', {}).items()))  # a part's libraries and kernel build, if held
    path = r.get('cpu_kernel_path') if isinstance(data, list) else None
    if path and 'forced by' in str(path[1]):  # the kernel's bfloat16 path held by its env variable
        held += (('TIMM_LAMBDA_CPU_BF16', path[0]),)
    if isinstance(data, list) and r.get('fast_model'):  # benchmarks/benchmark_timm_lambda.py
        return ('timm_models', r.get('size'))
    if isinstance(data, list) and r.get('layer') and 'cpu_timm_over_converted' in r:  # the same, --layers
        return ('timm_layers', r.get('size'))
    if isinstance(data, list) and r.get('comparison'):
        return ('models', r['comparison'], r.get('size'), r.get('batch'),
                str(r.get('dtype', 'float32')).replace('torch.', ''), _device(result), held)
    if isinstance(data, list) and 'max_rel_error' in r:
        return ('onnx', tuple(e['size'] for e in data))
    if isinstance(data, dict) and 'summed_ratio' in data:  # benchmarks/benchmark_cpu_isa.py
        held = {k: v for k, v in data.get('environment', {}).items() if k != 'OMP_WAIT_POLICY'}
        dtypes = tuple(sorted({row['dtype'] for row in data['results']}))
        return ('cpu_isa', tuple(sorted(data['builds'])), dtypes, len(data['results']), tuple(sorted(held.items())),
                _vendor(data))
    if isinstance(data, dict) and 'settings' in data and 'results' in data:  # benchmarks/benchmark_lambda_layer.py
        s = data['settings']
        if 'sweep' in data['command']:
            return ('sweep', s.get('scope'), s.get('dim_u'))
        first = data['results'][0]
        return ('layer', first['size'] * 16, s['mode'], s['dtype'], s['device'], held)  # c4's map: 1/16 the image
    if isinstance(data, dict) and data.get('section') in ('layer', 'mission'):  # tools/gpu_check.py
        res = data['results']  # what the run measured: its sections, and the model comparisons that ran
        ran = sorted(k for k, v in res.items() if v and k != 'models')
        return ('gpu_check', data['section'], tuple(ran + sorted(f'models.{k}' for k, v in res.get('models', {}).items()
                                                                 if v)))
    if isinstance(data, dict) and 'benchmark_table4.py' in data.get('command', ''):
        return ('table4', data['batch'], data['img_size'])
    if isinstance(data, dict) and 'tools/quickstart.py' in data.get('command', ''):
        return ('quickstart',)
    if isinstance(data, dict) and 'classification_quick_run.py' in data.get('command', ''):
        return ('quick_run',)
    for tool, key in (('host_time', 'host_time.py'), ('launches', 'count_launches.py'), ('macs', 'count_macs.py'),
                      ('sm90', 'sm90_kernels.py'), ('forward_walk', 'forward_walk.py'),
                      ('checkpoint_memory', 'checkpoint_memory.py'), ('projection', 'benchmark_projection.py')):
        if isinstance(data, dict) and key in data.get('command', ''):
            if tool == 'projection':  # (one a vendor and libraries' hold: a CPU's oneDNN decides the rule)
                return (tool, _vendor(data), tuple(sorted(data.get('environment', {}).items())))
            return (tool, data.get('triton')) if tool == 'sm90' else (tool,)
    return None


def _vendor(data: dict) -> str:
    """A result's CPU vendor, 'Intel' or 'AMD' ('' where unknown): its recorded vendor_id, else its CPU's name."""
    if data.get('vendor'):
        return VENDORS.get(data['vendor'], data['vendor'])
    text = str(data.get('cpu') or data.get('machine') or '')
    return next((v for v in ('Intel', 'AMD') if v in text), '')


def newest(kind: Tuple) -> Result:
    """The newest result of ``kind`` by its own date (then its name), runs of earlier code left out."""
    found = [r for r in results() if kind_of(r) == kind and not baseline(r)]
    if not found:
        raise LookupError(f'no result of kind {kind} in {RESULTS}')
    return max(found, key=lambda r: (str(r.get('date', '')), r.name))


# ---------------------------------------------------------------------------------------------------------------
# provenance


def _short_commit(commit) -> str:
    if not commit:
        return NOT_RECORDED
    head, _, rest = str(commit).partition(' ')
    return head[:7] + ('+dirty' if head.endswith('+dirty') else '') + (f' {rest}' if rest else '')


def _parts_of(result: Result) -> Dict[str, dict]:
    return result.data.get('parts', {}) if isinstance(result.data, dict) else {}


def _commit(result: Result) -> str:
    """The commit (each part's, where a JSON of parts ran them at several)."""
    parts = _parts_of(result)
    if parts:
        return ' / '.join(sorted({_short_commit(p.get('commit')) for p in parts.values()}))
    return _short_commit(result.get('commit'))


def _machine(result: Result) -> str:
    m = result.get('machine', NOT_RECORDED)
    if isinstance(m, dict):
        what = [m.get('gpu'), f"driver {m['driver']}" if m.get('driver') else None,
                f"torch {m['torch']}" if m.get('torch') else None, f"Triton {m['triton']}" if m.get('triton') else None,
                f"host {m['cpu']}" if m.get('cpu') and m.get('gpu') else m.get('cpu')]
        return ', '.join(w for w in what if w)
    return str(m).split(', load average')[0]


def _short(result: Result) -> str:
    """The machine in a few words: the GPU, or the CPU."""
    m = result.get('machine', NOT_RECORDED)
    if isinstance(m, dict):
        return m.get('gpu') or m.get('cpu') or NOT_RECORDED
    return str(m).split(' (143')[0].split(', torch')[0].split(' CPU,')[0].split(', host')[0]


def _isa(result: Result) -> str:
    r = result.record
    if _parts_of(result):  # each distinct kernel build and oneDNN instruction set its parts ran
        seen = dict.fromkeys((p['isa']['kernel_isa'], p['isa'].get('onednn_isa', 'not used'))
                             for p in _parts_of(result).values())
        return '; '.join(f'kernel {KERNEL_ISA.get(k, k)} with oneDNN at {o}' for k, o in seen)
    if r.get('isa') and isinstance(r['isa'], dict):  # a part of benchmarks/cpu_table.py: what the process ran
        i = r['isa']
        conv = i.get('conv_bfloat16') or i.get('conv_float32') or 'not run by oneDNN'
        builds = (result.data.get('builds') if isinstance(result.data, dict) else None) or {
            i['kernel_arch']: dict(isa=i['kernel_isa'])}  # the builds a program loaded side by side, or the one
        kernels = ', '.join(f"{KERNEL_ISA.get(b['isa'], b['isa'])} (-march={t})" for t, b in builds.items())
        return (f"kernel {kernels}, ATen {i['aten_capability']}, oneDNN {i.get('onednn_isa', 'not used')} (its "
                f"convolution: {conv})")
    if isinstance(result.data, dict) and result.data.get('builds'):
        return ', '.join(f"kernel {KERNEL_ISA.get(b['isa'], b['isa'])} (-march={t})"
                         for t, b in result.data['builds'].items())
    if _device(result) == 'cuda':
        return 'CUDA (the GPU named)'
    if result.get('target'):
        return str(result.get('target'))
    cpu = next((c for c in CPU_ISA if c in json.dumps(result.get('machine', ''))), None)
    return CPU_ISA[cpu] if cpu else NOT_RECORDED


def _link(name: str, page: str) -> str:
    rel = f"{'docs/' if page == 'README.md' else ''}results/{name.split('#')[0]}"
    return f"[{name}]({rel})"


def _loads(result: Result) -> str:
    """The 1-minute load averages recorded before and after the run (of each part, for a JSON of parts)."""
    records = list(_parts_of(result).values()) or [result.record]
    loads = []
    for r in records:
        for key in ('load_before', 'load_after'):
            value = r.get(key)
            value = value[0] if isinstance(value, list) else str(value or '').rpartition('load average ')[2]
            if re.match(r'\d', str(value)):
                loads.append(float(str(value).split()[0]))
    if not loads:
        return ''
    low, high = f'{min(loads):.1f}', f'{max(loads):.1f}'
    return f', load {low}' + (f' to {high}' if high != low else '')


def caption(sources: Sequence[Result], page: str) -> str:
    """One line naming each source: its JSON, commit, date, machine and load, instruction set and command."""
    parts = []
    for r in sources:
        parts.append(f"{_link(r.name, page)}: commit {_commit(r)}, {str(r.get('date', NOT_RECORDED))[:10]}, "
                     f"{_machine(r)}{_loads(r)}; instruction set: {_isa(r)}; `{r.get('command', NOT_RECORDED)}`")
    return '<sub>From ' + '; '.join(parts) + '.</sub>'


# ---------------------------------------------------------------------------------------------------------------
# figures


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


def x(value: Optional[float], digits: int = 2) -> str:
    return '-' if value is None else f'{value:.{digits}f}x'


def _times(entry: dict, name: str, mode: str) -> Optional[List[float]]:
    return entry['times'].get(f'{name}/{mode}')


def model_ratio(entry: dict, candidate: str, baseline_name: str, mode: str) -> float:
    return med(_times(entry, candidate, mode)) / med(_times(entry, baseline_name, mode))


def _spread(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
    return f'{med(values) * scale:.{digits}f} [{min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f}]'


def _models(entry: dict) -> List[str]:
    return list(dict.fromkeys(k.split('/')[0] for k in entry['times']))


def models_table(result: Result) -> List[str]:
    """A benchmark_models.py comparison: per model the training step and inference, median [min-max] in seconds and
    x the first baseline, and the training step's peak memory."""
    out = []
    for entry in result.data:
        names = _models(entry)
        base = names[1]
        if len(result.data) > 1:
            out += [f"{entry['comparison']}, {entry.get('size')} px, batch {entry.get('batch')}:", '']
        out += [f'| model | training step (s) | x {base} | inference (s) | x {base} | peak MiB (training) |',
                '|---|---|---:|---|---:|---:|']
        for m in names:
            peak = entry.get('peak_mib', {}).get(m)
            cells = [m]
            for mode in ('training step', 'inference'):
                t = _times(entry, m, mode)
                cells += [_spread(t) if t else '-', x(model_ratio(entry, m, base, mode)) if t else '-']
            cells.append(f'{peak:.0f}' if peak else '-')
            out.append('| ' + ' | '.join(cells) + ' |')
    return out


def models_settings(settings: Sequence[Tuple[str, Tuple]]) -> Renderer:
    """One comparison under several settings, a row each: (label, kind) -> the newest result of each kind; the first
    model over the second (its baseline) and the last (the bound) over the baseline, training step and inference,
    the first model's training step, median [min-max] seconds, and the two models' peak memory."""
    def render(page):
        sources = [newest(kind) for _, kind in settings]
        out = None
        for (label, _), src in zip(settings, sources):
            e = src.data[0]
            names = _models(e)
            lam, base, bound = names[0], names[1], names[-1]
            if out is None:
                out = [f'| setting | {lam} / {base}: training step; inference | {bound} / {base} | {lam} training '
                       f'step (s) | peak MiB, {lam} / {base} |', '|---|---|---|---|---|']
            peak = e.get('peak_mib', {})
            out.append(f"| {label} | {x(model_ratio(e, lam, base, 'training step'))}; "
                       f"{x(model_ratio(e, lam, base, 'inference'))} | "
                       f"{x(model_ratio(e, bound, base, 'training step'))}; "
                       f"{x(model_ratio(e, bound, base, 'inference'))}"
                       f" | {_spread(_times(e, lam, 'training step'))} | "
                       f"{peak.get(lam, 0):.0f} / {peak.get(base, 0):.0f} |")
        return sources, out
    return render


def compile_table(page: str) -> Tuple[List[Result], List[str]]:
    """benchmark_models.py compile at each size: the training step compiled by inductor, min / median / max, x the
    compiled baseline, and the first step's time (compiling)."""
    sources = [newest(cpu('compile', size, 1)) for size in (512, 1024)]
    out = ['| input, model | min / median / max (s) | x compiled RS-101+SE | first step, compiling (s) |',
           '|---|---|---:|---:|']
    for src in sources:
        entry = src.data[0]
        base = med(entry['times']['ResNet-RS-101+SE compiled'])
        for name, t in entry['times'].items():
            first = entry.get('first_step_s', {}).get(name.replace(' compiled', ''))
            out.append(f"| {entry['size']} px, {name} | {min(t):.3f} / {med(t):.3f} / {max(t):.3f} | "
                       f"{x(med(t) / base)} | {f'{first:.1f}' if first and 'compiled' in name else '-'} |")
    return sources, out


def onnx_table(result: Result) -> List[str]:
    out = ['| input | exporter | LambdaResNet-101, median (s) | ResNet-RS-101+SE (s) | ratio '
           '| max rel. error vs eager |',
           '|---|---|---:|---:|---:|---:|']
    for entry in result.data:
        for e in ('legacy', 'dynamo'):
            a, b = entry['times'][f'LambdaResNet-101 {e}'], entry['times'][f'ResNet-RS-101+SE {e}']
            out.append(f"| {entry['size']} px | {e} | {med(a):.3f} | {med(b):.3f} | {x(med(a) / med(b))} | "
                       f"{entry['max_rel_error'][f'LambdaResNet-101 {e}']:.1e} |")
    return out


def layer_table(result: Result) -> List[str]:
    """benchmark_lambda_layer.py: per shape the conv and the layer, median [min-max] ms, the layer's multiply-add
    rate and share of the CPU's float32 limit, x the conv, peak MiB; the shapes summed."""
    rows = result.data['results']
    out = ['| width, input, stride | conv (ms) | lambda layer (ms) | x conv | layer GMAC/s (share of the limit) '
           '| peak MiB, conv / layer |', '|---|---|---|---:|---:|---|']
    for r in rows:
        c, a = r['conv3x3'], r['auto']
        share = f" ({100 * a['share_of_fma_peak']:.0f}%)" if a.get('share_of_fma_peak') else ''
        out.append(f"| {r['width']}, {r['size']}x{r['size']}, {r['stride']} | {c['ms']:.1f} [{c['min_ms']:.1f}-"
                   f"{c['max_ms']:.1f}] | {a['ms']:.1f} [{a['min_ms']:.1f}-{a['max_ms']:.1f}] | "
                   f"{x(a['ms'] / c['ms'])} | {a.get('gmac_per_s', 0):.0f}{share} | "
                   f"{c['peak_mib']:.0f} / {a['peak_mib']:.0f} |")
    total = sum(r['auto']['ms'] for r in rows) / sum(r['conv3x3']['ms'] for r in rows)
    out.append(f"| **summed** | {sum(r['conv3x3']['ms'] for r in rows):.1f} | {sum(r['auto']['ms'] for r in rows):.1f}"
               f" | **{x(total)}** | | |")
    return out


def sweep_table(result: Result) -> List[str]:
    """The dense and tiled forms against the conv by map size; bold: the faster form where its median beats the
    other's fastest round, ~: within each other's spread."""
    rows, s = [r for r in result.data['results'] if 'dense' in r and 'tiled' in r], result.data['settings']
    head = f"side (px), {s['scope']}x{s['scope']} scope" + (f", \\|u\\|={s['dim_u']}" if s.get('dim_u', 1) > 1 else '')
    out = ['| ' + ' | '.join([head] + [str(r['size']) for r in rows]) + ' |', '|---' * (len(rows) + 1) + '|',
           '| 3x3 conv | ' + ' | '.join(f"{r['conv3x3']['ms']:.1f}" for r in rows) + ' |']
    for form, other in (('dense', 'tiled'), ('tiled', 'dense')):
        cells = []
        for r in rows:
            a, b = r[form], r[other]
            text = f"{a['ms']:.1f}"
            if a['ms'] < b['min_ms']:
                text = f'**{text}**'
            elif b['ms'] >= a['min_ms'] and not b['ms'] < a['min_ms']:
                text = f'~{text}'
            cells.append(text)
        out.append(f'| {form} | ' + ' | '.join(cells) + ' |')
    return out


def cpu_isa_table(result: Result, dtypes: Sequence[str] = ('float32', 'bfloat16')) -> List[str]:
    """benchmark_cpu_isa.py: per shape, step and dtype (of ``dtypes``) the conv's median ms and each candidate's (x the
    conv, the backend that served it); the three shapes summed."""
    rows = [r for r in result.data['results'] if r['dtype'] in dtypes]
    names = list(dict.fromkeys(k for r in rows for k in r if isinstance(r[k], dict) and k != 'conv3x3'))

    def cell(r, n):
        return f"{r[n]['ms']:.0f} ({x(r[n]['ratio'])}) {'/'.join(r[n]['served'])}" if n in r else '-'
    out = ['| shape | step, dtype | 3x3 conv (ms) | ' + ' | '.join(names) + ' |',
           '|---|---|---:|' + '---|' * len(names)]
    for r in rows:
        shape = f"{r['width']} ch {r['size']}x{r['size']}" + (f" s{r['stride']}" if r['stride'] > 1 else '')
        out.append(f"| {shape} | {r['mode']}, {r['dtype']} | {r['conv3x3']['ms']:.0f} | "
                   + ' | '.join(cell(r, n) for n in names) + ' |')
    for key, sums in result.data['summed_ratio'].items():
        if 'CPU time' not in key and key.split()[-1] in dtypes:
            out.append(f'| **summed** | {key} | 1 | ' + ' | '.join(f'**{x(sums[n])}**' if n in sums else '-'
                                                                   for n in names) + ' |')
    return out


def cpu_isa_dtypes_table(result: Result) -> List[str]:
    """benchmark_cpu_isa.py, float32 and bfloat16: per shape and step the 3x3 conv's median ms in each dtype and each
    candidate's median [min-max] ms in each, with its bfloat16 step over its float32 step (issue 62's item 1)."""
    rows: Dict[Tuple, Dict[str, dict]] = {}
    for r in result.data['results']:
        rows.setdefault((r['width'], r['size'], r['stride'], r['mode']), {})[r['dtype']] = r
    names = list(dict.fromkeys(k for r in result.data['results'] for k in r
                               if isinstance(r[k], dict) and k != 'conv3x3'))
    out = ['| shape | step | 3x3 conv float32 / bfloat16 (ms) | '
           + ' | '.join(f'{n}: float32 / bfloat16 (ms), bfloat16 / float32' for n in names) + ' |',
           '|---|---|---:|' + '---:|' * len(names)]

    def ms(f):
        return f"{f['ms']:.1f} [{f['min_ms']:.1f}-{f['max_ms']:.1f}]"
    for (width, size, stride, mode), by in rows.items():
        f32, b16 = by['float32'], by['bfloat16']
        shape = f'{width} ch {size}x{size}' + (f' s{stride}' if stride > 1 else '')
        cells = [f"{ms(f32[n])} / {ms(b16[n])}, **{x(b16[n]['ms'] / f32[n]['ms'])}**" for n in names]
        out.append(f"| {shape} | {mode} | {f32['conv3x3']['ms']:.0f} / {b16['conv3x3']['ms']:.0f} | "
                   + ' | '.join(cells) + ' |')
    return out


def cpu_isa_bf16_table(result: Result) -> List[str]:
    """:func:`cpu_isa_table` of the bfloat16 rows."""
    return cpu_isa_table(result, ('bfloat16',))


def projection_table(result: Result) -> List[str]:
    """benchmark_projection.py: the 1x1 projection's step as oneDNN's convolution and as the batched matmul (and a
    bfloat16 call's convolution in float32, where timed), per shape and step, each dtype a column (conv ms / matmul
    ms, their ratio, and the one the layer takes there)."""
    rows: Dict[Tuple, Dict[str, dict]] = {}
    for r in result.data['results']:
        rows.setdefault((r['batch'], r['d'], r['out'], r['size'], r['mode']), {})[r['dtype']] = r
    dtypes = list(dict.fromkeys(r['dtype'] for r in result.data['results']))
    out = ['| batch, d -> out, map | step | ' + ' | '.join(f'{d}: conv / matmul (ms)' for d in dtypes) + ' |',
           '|---|---|' + '---|' * len(dtypes)]
    def cell(r):  # (float32: a bfloat16 call's convolution in float32, rounded; its column where the run timed it)
        f32 = f", float32 {r['float32_ms']:.2f} ({x(r['float32_ratio'])})" if 'float32_ms' in r else ''
        taken = r.get('taken', 'matmul' if r['as_matmul'] else 'conv')
        return f"{r['conv_ms']:.2f} / {r['matmul_ms']:.2f} ({x(r['ratio'])}){f32}, {taken} taken"
    for (batch, d, o, size, mode), by in rows.items():
        cells = [cell(r) if r else '-' for r in (by.get(t) for t in dtypes)]
        out.append(f'| {batch}, {d} -> {o}, {size}x{size} | {mode} | ' + ' | '.join(cells) + ' |')
    return out


def launches_table(result: Result) -> List[str]:
    rows = [r for r in result.data['rows']  # LambdaResNet-101's shapes, float32
            if r['mode'] in ('train f32', 'eval f32') and r['shape'].startswith(('c4', 'c5'))]
    backends = list(rows[0]['backends'])
    out = ['| layer | step | 3x3 conv | ' + ' | '.join(f'`{b}` (aten + Triton)' for b in backends) + ' |',
           '|---|---|---:|' + '---:|' * len(backends)]
    for r in rows:
        cells = [f"{r['backends'][b]['aten']}" + (f" + {r['backends'][b]['triton']}" if r['backends'][b]['triton']
                                                   else '') for b in backends]
        out.append(f"| {r['shape']} | {r['mode']} | {r['conv']} | " + ' | '.join(cells) + ' |')
    return out


def sm90_table(result: Result) -> List[str]:
    """sm90_kernels.py, LambdaResNet-101's shapes, bfloat16 and float32 (TF32 on tensor cores): per kernel (the rows
    forward / its logit gradient / the value gradient) registers, spilled bytes, programs a multiprocessor, ``wgmma``
    and ``cp.async`` instructions, warps and pipeline stages."""
    rows = [r for r in result.data['rows'] if r['shape'] != 'odd' and r['dtype'] in ('bf16', 'fp32')
            and r['tensor_cores']]
    keys = list(dict.fromkeys((r['shape'], r['dtype']) for r in rows))
    fields = ('registers', 'spill_stores', 'programs_per_sm', 'wgmma', 'cp_async', 'num_warps', 'num_stages')
    out = ['| shape | dtype | registers | spilled bytes | programs / SM | wgmma | cp.async | warps | stages |',
           '|---|---|---|---|---|---|---|---|---|']
    for shape, dtype in keys:
        group = [r for r in rows if (r['shape'], r['dtype']) == (shape, dtype)]
        out.append(f"| {shape} | {'TF32' if dtype == 'fp32' else dtype} | " + ' | '.join(
            ' / '.join(str(r.get(f, '-')) for r in group) for f in fields) + ' |')
    return out


def macs_table(result: Result) -> List[str]:
    """count_macs.py: per shape and dtype, the multiply-adds issued over the query-side form's, forward, backward and
    training step, and the floor of any ``tl.dot`` tiling."""
    out = ["| shape | dtype | forward | backward | training step | floor (training step) |",
           "|---|---|---:|---:|---:|---:|"]
    for r in result.data['rows']:
        ratio = r['ratio']
        out.append(f"| {r['shape']} | {r['dtype']} | {x(ratio['forward'])} | {x(ratio['backward'])} | "
                   f"{x(ratio['train'])} | {x(r['floor']['train'])} |")
    return out


def _table4_rows(result: Result, full: bool) -> List[str]:
    def f(value, spec, none='-'):
        return none if value is None else format(value, spec)
    out = []
    for r in result.data['rows']:
        measured = f"{r['measured_gib']:.2f}" if r['measured_gib'] is not None else (
            f"not run (estimated above {result.data['max_gib']:g} GiB)")
        paper_ratio = 'OOM' if r['paper_throughput'] is None else f"{r['paper_ratio']:.2f}"
        cells = [r['layer'].replace('|', '\\|')] + ([f"`{r['model']}`"] if full else []) + [
            r['complexity'], f(r['paper_gb'], 'g'), f"{r['analytic_gib']:.3g}", measured, paper_ratio,
            f(r['train_ratio'], '.2f'), f(r['infer_ratio'], '.2f')]
        if full:
            cells += [f(r['train_s'], '.2f'), f"{r['params_m']:.1f}", f(r['paper_top1'], 'g', 'OOM')]
        out.append('| ' + ' | '.join(cells) + ' |')
    return out


def table4_table(result: Result) -> List[str]:
    """benchmark_table4.py: LambdaNetworks Table 4 beside ours (docs/table4.md says what each column is)."""
    b = result.data['batch']
    return ['| Layer | model | complexity | memory, paper (GB) | memory, analytic (GiB) | measured peak (GiB) '
            '| time ratio, paper | ours, training | ours, inference | train step (s) | params (M) | top-1, paper |',
            '|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|'] + _table4_rows(result, True) + [
        '', f"{result.data['img_size']} px, batch {b}, float32" + (
            f", {result.data['repeats']} interleaved rounds, medians" if any(r['train_s'] for r in result.data['rows'])
            else ': peak memory only, no time measured (--memory-only)') + '; load average before: '
        f"{result.data['machine'].rsplit('load average ', 1)[-1]}, after: "
        f"{result.data['load_after'].rsplit('load average ', 1)[-1]}."]


def table4_summary(result: Result) -> List[str]:
    """The same, the columns that compare with the paper."""
    b = result.data['batch']
    return ['| Layer | complexity | memory, paper (GB, b=128) | analytic (GiB, b=128) | measured peak, training step '
            f'(GiB, b={b}) | time ratio, paper (inference) | ours, training step | ours, inference |',
            '|---|---|---:|---:|---:|---:|---:|---:|'] + _table4_rows(result, False)


def quickstart_table(result: Result) -> List[str]:
    """tools/quickstart.py: the held-out COCO AP of the main job's model, and how long the job took."""
    m = result.data['metrics']
    return ['| held-out bbox AP50 | segm AP50 | bbox AP | segm AP | the whole job (s) |',
            '|---:|---:|---:|---:|---:|',
            f"| {m['coco/bbox_mAP_50']:.3f} | {m['coco/segm_mAP_50']:.3f} | {m['coco/bbox_mAP']:.3f} | "
            f"{m['coco/segm_mAP']:.3f} | {result.data['seconds']:.0f} |"]


def quick_run_table(result: Result) -> List[str]:
    """tools/classification_quick_run.py: held-out top-1 after each epoch, then the final, chance and the time."""
    r = result.data['result']
    epochs = r['epochs']
    return ['| epoch | ' + ' | '.join(str(e['epoch']) for e in epochs) + ' |', '|---' * (len(epochs) + 1) + '|',
            '| held-out top-1 (%) | ' + ' | '.join(f"{e['val_top1']:.1f}" for e in epochs) + ' |', '',
            f"Final held-out top-1 **{r['val_top1']:.1f}%** against chance {r['chance']:.1f}% (train top-1 "
            f"{epochs[-1]['train_top1']:.1f}%), in {result.data['seconds']:.0f} s."]


# --- timm's lambda networks on this layer (benchmarks/benchmark_timm_lambda.py) -------------------------------------


def _dtype(record: dict) -> str:
    return 'float32' if 'float32' in str(record['dtype']) else 'bf16 autocast'


def timm_models_table(result: Result) -> List[str]:
    """timm's model over its conversion (> 1: the converted model is faster), CPU time, training step and inference,
    float32 and bf16 autocast; then the process's seconds of the converted model's training step."""
    rows: Dict[str, Dict[str, dict]] = {}
    for r in result.data:
        rows.setdefault(r['model'], {})[_dtype(r)] = r
    dtypes = ['float32', 'bf16 autocast']
    out = ['| model | ' + ' | '.join(f'{m}, {d}' for d in dtypes for m in ('training step', 'inference'))
           + ' | converted training step, float32 (CPU s) |', '|---|' + '---:|' * 5]
    for model, by in rows.items():
        cells = [x(by[d]['cpu_timm_over_converted'][m]) if d in by else '-'
                 for d in dtypes for m in ('training step', 'inference')]
        f32 = by.get('float32')
        cells.append(f"{f32['cpu_median_s']['converted/training step']:.2f}" if f32 else '-')
        out.append(f'| `{model}` | ' + ' | '.join(cells) + ' |')
    return out


def timm_layers_table(result: Result) -> List[str]:
    """Each lambda layer alone, on its input in its model: timm's training step over the converted layer's, CPU
    time, float32 and bf16 autocast."""
    rows: Dict[Tuple[str, str], Dict[str, dict]] = {}
    for r in result.data:
        rows.setdefault((r['model'], r['layer']), {})[_dtype(r)] = r
    out = ['| model | layer | input | stride | scope | timm / converted, float32 | bf16 autocast |',
           '|---|---|---|---:|---|---:|---:|']
    for (model, layer), by in rows.items():
        r = next(iter(by.values()))
        out.append(f"| `{model}` | `{layer}` | {'x'.join(map(str, r['input_shape']))} | {r['stride']} | {r['scope']} | "
                   + ' | '.join(x(by[d]['cpu_timm_over_converted']) if d in by else '-'
                                for d in ('float32', 'bf16 autocast')) + ' |')
    return out


def timm_layers(page: str) -> Tuple[List[Result], List[str]]:
    """:func:`timm_layers_table`, then each model's lambda layers' share of timm's float32 training step (the layers'
    CPU medians summed, over the model's)."""
    layers, models = newest(('timm_layers', 256)), newest(('timm_models', 256))
    shares = []
    for m in models.data:
        if _dtype(m) == 'float32':
            summed = sum(r['cpu_median_s']['timm'] for r in layers.data
                         if r['model'] == m['model'] and _dtype(r) == 'float32')
            shares.append(f"`{m['model']}` {100 * summed / m['cpu_median_s']['timm/training step']:.0f}%")
    return [layers, models], timm_layers_table(layers) + [
        '', "timm's lambda layers' share of timm's float32 training step: " + ', '.join(shares) + '.']


def _range(values: Sequence[float], digits: int = 2) -> str:
    return f'{min(values):.{digits}f}-{max(values):.{digits}f}x'


def timm_summary(page: str) -> Tuple[List[Result], List[str]]:
    """One sentence: what a timm user gains, the layers alone and the whole model, ranges over the three models."""
    layers, models = newest(('timm_layers', 256)), newest(('timm_models', 256))

    def lay(d):
        return _range([r['cpu_timm_over_converted'] for r in layers.data if _dtype(r) == d], 1)
    steps = [v for r in models.data for v in r['cpu_timm_over_converted'].values()]
    return [layers, models], [f"On this CPU at 256 px, timm's time over the converted: each lambda layer's training "
                              f"step {lay('float32')} in float32 ({lay('bf16 autocast')} under bf16 autocast), a whole "
                              f"training or inference step {_range(steps)}."]


# --- the plan (issue 58): the files a call enters, the host's time, checkpointing -----------------------------------


def _runs(program: str, vendor: str = 'Intel') -> Tuple[Result, List[dict], List[dict]]:
    """The newest benchmarks/before_after.py run of ``program`` on a CPU of ``vendor``: it, its runs before and its
    runs after."""
    src = newest(('before_after', program, vendor))
    return src, src.data['runs']['before'], src.data['runs']['after']


def forward_walk_table(page: str) -> Tuple[List[Result], List[str]]:
    """benchmarks/forward_walk.py before and after: stays in the package's files and returns to a file already left."""
    src, (before,), (after,) = _runs('forward_walk.py')
    b = _short_commit(src.get('before_commit'))
    out = [f'| call | before ({b}): stays in files, returns to a file left | after |', '|---|---|---|']
    for what, a in after['results'].items():
        b = before['results'].get(what)
        cell = '{stays} in {files}, {returns}'
        out.append(f"| {what} | {cell.format(**b) if b else '-'} | {cell.format(**a)} |")
    return [src], out


def host_time_pairs(page: str) -> Tuple[List[Result], List[str]]:
    """benchmarks/host_time.py, runs before and after alternated: per stride and step the median over the runs of
    each run's median CPU microseconds, the layer's and the conv's, and after / before."""
    src, before, after = _runs('host_time.py')

    def us(runs, stride, mode, name):
        return med([row['us'][name] for r in runs for row in r['rows']
                    if (row['stride'], row['mode']) == (stride, mode) and name in row['us']])
    out = [f"| stride, step | conv (us) | layer before, {_short_commit(src.get('before_commit'))} (us) | "
           'layer after (us) | after / before |',
           '|---|---:|---:|---:|---:|']
    for row in after[0]['rows']:
        key = (row['stride'], row['mode'])
        b, a = us(before, *key, 'lambda'), us(after, *key, 'lambda')
        out.append(f"| {key[0]}, {key[1]} | {us(after + before, *key, 'conv'):.0f} | {b:.0f} | {a:.0f} | {x(a / b)} |")
    return [src], out + ['', f"{len(before)} runs before ({_short_commit(src.get('before_commit'))}) and {len(after)} "
                         f"after, alternated; setting: {after[0]['setting']}."]


def layer_pairs(page: str) -> Tuple[List[Result], List[str]]:
    """benchmarks/benchmark_lambda_layer.py before and after, back to back: per shape the median over the runs of the
    layer's time over its conv's."""
    src, before, after = _runs('benchmark_lambda_layer.py')

    def ratios(runs, i):
        return [r['results'][i]['auto']['ms'] / r['results'][i]['conv3x3']['ms'] for r in runs]
    out = [f"| shape | layer / conv before ({_short_commit(src.get('before_commit'))}) | after |", '|---|---:|---:|']
    for i, row in enumerate(after[0]['results']):
        shape = f"{row['width']} ch {row['size']}x{row['size']}" + (f" s{row['stride']}" if row['stride'] > 1 else '')
        out.append(f'| {shape} | {x(med(ratios(before, i)))} | {x(med(ratios(after, i)))} |')

    def summed(runs):
        return med([sum(e['auto']['ms'] for e in r['results']) / sum(e['conv3x3']['ms'] for e in r['results'])
                    for r in runs])
    return [src], out + [f'| **summed** | {x(summed(before))} | {x(summed(after))} |']


def cpu_isa_pairs(page: str, vendor: str = 'Intel') -> Tuple[List[Result], List[str]]:
    """benchmarks/benchmark_cpu_isa.py before and after on a CPU of ``vendor``, alternated: per shape, step and dtype
    the median over the runs of the kernel's time over the conv's of the same run (``cpu_kernel[native]``: the path
    chosen), and summed."""
    src, before, after = _runs('benchmark_cpu_isa.py', vendor)
    name = 'cpu_kernel[native]'

    def ratios(runs, i):
        return [r['results'][i][name]['ratio'] for r in runs]
    b = _short_commit(src.get('before_commit'))
    out = [f'| shape | step, dtype | layer / conv before ({b}) | after ({_short_commit(src.get("commit"))}) |',
           '|---|---|---:|---:|']
    for i, row in enumerate(after[0]['results']):
        shape = f"{row['width']} ch {row['size']}x{row['size']}" + (f" s{row['stride']}" if row['stride'] > 1 else '')
        out.append(f"| {shape} | {row['mode']}, {row['dtype']} | {x(med(ratios(before, i)))} | "
                   f"{x(med(ratios(after, i)))} |")
    def spread(runs, key):
        sums = [r['summed_ratio'][key][name] for r in runs]
        return f'{x(min(sums))}-{x(max(sums))}'
    for key in after[0]['summed_ratio']:
        if 'CPU time' not in key:
            out.append(f'| **summed** | {key} | {spread(before, key)} | {spread(after, key)} |')
    return [src], out + ['', f'{len(before)} runs before and {len(after)} after, alternated, each its own process '
                         f"(summed: the runs' range); {after[0]['threads']} thread(s)."]


def checkpoint_table(page: str) -> Tuple[List[Result], List[str]]:
    """benchmarks/checkpoint_memory.py, before and after: each stack's step peak, plain and checkpointed, and their
    ratio; the gradients' sums equal."""
    src, (before,), (after,) = _runs('checkpoint_memory.py')
    out = [f"| stack | before ({_short_commit(src.get('before_commit'))}): plain / checkpointed step peak (MiB), "
           'ratio | after | gradients equal |', '|---|---|---|---|']
    for kind in ('lambda', 'conv'):
        cells, equal = [], True
        for r in (before, after):
            plain, ckpt = (next(row for row in r['rows'] if row['kind'] == kind and row['checkpointed'] is c)
                           for c in (False, True))
            cells.append(f"{plain['step_peak_mib']:.0f} / {ckpt['step_peak_mib']:.0f}, "
                         f"{x(ckpt['step_peak_mib'] / plain['step_peak_mib'])}")
            equal &= plain['grad_sum'] == ckpt['grad_sum']
        out.append(f"| {kind} | {' | '.join(cells)} | {'yes' if equal else 'no'} |")
    return [src], out + ['', f"Setting: {after['setting']}."]


# --- GPU (tools/gpu_check.py) ------------------------------------------------------------------------------------


def _layer_vs_conv(data: dict, execution: str, dtype: str, batch: int, mode: str) -> Optional[float]:
    found = [e for e in data['results']['layer_vs_conv'] if (e['execution'], e['dtype'], e['batch'], e['mode'])
             == (execution, dtype, batch, mode)]
    return found[0]['ratio_summed'] if found else None


def gpu_layer_table(result: Result) -> List[str]:
    data = result.data
    executions = list(dict.fromkeys(e['execution'] for e in data['results']['layer_vs_conv']))
    out = ['| execution | f32 b1 train | bf16 b1 train | f32 b8 train | bf16 b8 train | b1 eval f32 / bf16 | '
           'b8 eval f32 / bf16 |', '|---|---:|---:|---:|---:|---:|---:|']
    for ex in executions:
        cells = [x(_layer_vs_conv(data, ex, d, b, 'train')) for b in (1, 8) for d in ('float32', 'bfloat16')]
        cells += [' / '.join(x(_layer_vs_conv(data, ex, d, b, 'eval')) for d in ('float32', 'bfloat16'))
                  for b in (1, 8)]
        out.append(f'| {ex} | ' + ' | '.join(cells) + ' |')
    graphs = data['results'].get('cuda_graphs_batch1')
    if graphs:
        def summed(prefix, key):
            return sum(r[key] for r in graphs if r['case'].startswith(prefix))
        graphed = summed('auto', 'graphed_ms') / summed('conv3x3', 'graphed_ms')
        out.append(f'| replayed from CUDA graphs (b1 train, TF32) | {x(graphed)} | | | | | |')
    return out


def _device_times(data: dict, dtype: str) -> List[float]:
    us = {(p['shape'], p['module']): p['device_us'] for p in data['results']['tc_kernels']['profile']
          if p['dtype'] == dtype}
    return [us[(s, 'lambda')] / us[(s, 'conv3x3')] for s in ('c4', 'c5_s2', 'c5')]


def _pick(rows: list, **fields) -> dict:
    found = [r for r in rows if all(r.get(k) == v for k, v in fields.items())]
    assert len(found) == 1, (fields, len(found))
    return found[0]


def gpu_models_rows(layer: Result, b1: Result, cuda: Result, mission: Result) -> List[Tuple[str, str, str]]:
    """(comparison, training step, inference) of the GPU check's model comparisons."""
    g = {r['case']: r for r in layer.data['results']['models']['models_graphs'][0]['rows']}
    lam, se = 'LambdaResNet-101', 'ResNet-RS-101+SE'
    bb = _pick(b1.data, comparison='backbone', batch=1)
    c4 = mission.data['results']['models']['models_c4'][0]
    graphed = g[f'{lam} features 1024px']['graphed_ms'] / g[f'{se} features 1024px']['graphed_ms']
    c4g = (g['LambdaResNet-101-C4 features 512px']['graphed_ms']
           / g['LambdaResNet-101-C4 conv twin features 512px']['graphed_ms'])
    rows = [(f'{lam} / {se}, backbone, 1024 px, batch 1, float32; replayed from CUDA graphs',
             f"{x(model_ratio(bb, lam, se, 'training step'))}; graphed {x(graphed)}",
             x(model_ratio(bb, lam, se, 'inference')))]
    for d in ('torch.float32', 'torch.bfloat16'):
        e = _pick(cuda.data, comparison='backbone', batch=4, dtype=d)
        rows.append((f"the same, batch 4, {d.split('.')[1]}{' autocast' if 'bf' in d else ''}",
                     x(model_ratio(e, lam, se, 'training step')), x(model_ratio(e, lam, se, 'inference'))))
    rows.append(('LambdaResNet-101-C4 / its conv twin, 512 px, batch 1, float32; graphed',
                 f"{x(model_ratio(c4, 'LambdaResNet-101-C4', 'LambdaResNet-101-C4 conv twin', 'training step'))}; "
                 f"graphed {x(c4g)}",
                 x(model_ratio(c4, 'LambdaResNet-101-C4', 'LambdaResNet-101-C4 conv twin', 'inference'))))
    return rows


GPU_LAYER = ('gpu_check', 'layer', ('cuda_graphs_batch1', 'cuda_tests_kernels', 'layer_vs_conv', 'tc_kernels',
                                    'models.models_graphs'))
GPU_MISSION = ('gpu_check', 'mission', ('cuda_tests_models', 'mask_rcnn', 'timm_scripts', 'models.models_c4',
                                        'models.models_reduce_overhead'))


def _gpu_sources() -> List[Result]:
    """The GPU check's layer and mission sections and the model comparisons run beside them."""
    return [newest(GPU_LAYER), newest(('models', 'backbone', 1024, 1, 'float32', 'cuda', ())),
            newest(('models', 'backbone', 1024, 4, 'float32', 'cuda', ())), newest(GPU_MISSION)]


def gpu_models_table(page: str) -> Tuple[List[Result], List[str]]:
    sources = _gpu_sources()
    out = ['| comparison | training step | inference |', '|---|---|---|']
    out += [f'| {a} | {b} | {c} |' for a, b, c in gpu_models_rows(*sources)]
    return sources, out


def readme_gpu(page: str) -> Tuple[List[Result], List[str]]:
    """The README's GPU table: the layer against cuDNN's conv and the models, and the layer's device time."""
    sources = _gpu_sources()
    data = sources[0].data
    layer = [('one lambda layer / its 3x3 conv, 1024 px shapes summed, batch 8, TF32 / bf16 autocast',
              ' / '.join(x(_layer_vs_conv(data, 'triton_tc', d, 8, 'train')) for d in ('float32', 'bfloat16')),
              ' / '.join(x(_layer_vs_conv(data, 'triton_tc', d, 8, 'eval')) for d in ('float32', 'bfloat16')))]
    f32, bf16 = _device_times(data, 'float32'), _device_times(data, 'bfloat16')
    layer.append(('the same, batch 8, the layer\'s GPU time alone (torch.profiler) / the conv\'s, TF32 / bf16',
                  f'{x(min(f32), 1)}-{x(max(f32), 1)} / {x(min(bf16), 1)}-{x(max(bf16), 1)}', '-'))
    out = ['| workload | training step | inference |', '|---|---|---|']
    out += [f'| {a} | {b} | {c} |' for a, b, c in layer + gpu_models_rows(*sources)]
    return sources, out


# --- the README's CPU table (benchmarks/cpu_table.py) --------------------------------------------------------------

SAME = 'as the first column (AMX computes 16-bit types only)'
NOT_MEASURED = 'not measured'
VENDORS = {'GenuineIntel': 'Intel', 'AuthenticAMD': 'AMD'}
# the README's rows: (label, the layer's dtype or the part of a model comparison, without its class's suffix)
CPU_ROWS = (("one lambda layer / its 3x3 conv, LambdaResNet-101's c4 and c5 shapes at 1024 px summed, batch 1, "
             'float32', ('layer', 'float32')),
            ("the same, bfloat16 autocast", ('layer', 'bfloat16')),
            ('LambdaResNet-101-C4 / its conv twin, 512 px, batch 1, float32', ('c4', None)),
            ('the same, bfloat16 autocast', ('c4_bf16', None)),
            ('LambdaResNet-101 / ResNet-RS-101+SE, backbone c2..c5, 1024 px, batch 1, float32', ('backbone', None)),
            ('the same, bfloat16 autocast', ('backbone_bf16', None)),
            ('LambdaResNet-101 / ResNet-RS-101+SE, classifier, 224 px, batch 2, float32', ('classification', None)))


@dataclass(frozen=True)
class CpuColumn:
    """A column of the README's CPU table: its heading, the table file it reads and the parts of each row there
    (a row's part name, :data:`SAME`, or missing: not measured), the kernel build its layer rows name."""
    label: str
    source: Result
    parts: Dict[Tuple[str, Optional[str]], str]
    target: str = 'native'

    def part(self, row) -> Optional[dict]:
        name = self.parts.get(row)
        if isinstance(name, tuple):  # the kind of a result outside the table (its own run, named in the caption)
            return dict(result=newest(name).data)
        return self.source.data['parts'].get(name) if name not in (None, SAME) else None

    def sources(self) -> List[Result]:
        return [self.source] + [newest(n) for n in self.parts.values() if isinstance(n, tuple)]


def cpu_class(source: Result) -> str:
    """A CPU's class in a few words, from its layer part's flags and vendor: 'Intel AVX-512 + AMX', 'AMD AVX-512 +
    AVX-512 BF16', ... (the vendor alone where the run did not record its flags)."""
    layer = source.data['parts'].get('layer', {}).get('result', {})
    flags = set(layer.get('cpu_flags') or ())
    vendor = _vendor(layer) or _vendor(source.data) or 'CPU'
    isa = ('AVX-512 + AMX' if 'amx_bf16' in flags else 'AVX-512 + AVX-512 BF16' if 'avx512_bf16' in flags
           else 'AVX-512' if 'avx512f' in flags else 'AVX2 + FMA' if 'avx2' in flags else '')
    return f'{vendor} {isa}'.strip()


def cpu_columns() -> List[CpuColumn]:
    """The README's CPU columns: the main table's CPU as it is, then held to AVX-512 BF16 without AMX (oneDNN) and
    to AVX2 + FMA (the kernel's build and every library), then each other CPU's table (cpu_table_<vendor>.json)."""
    main = _parts()
    model = str(main.data.get('cpu', '')).replace('(R)', '')
    own = {row: row[0] for _, row in CPU_ROWS}  # (each row's own part)
    out = [CpuColumn(f'{cpu_class(main)}: {model}', main,
                     # the bfloat16 backbone: its own run, one thread (benchmarks/benchmark_models.py)
                     {**own, ('backbone_bf16', None): cpu('backbone', 1024, 1, 'bfloat16')}),
           CpuColumn('Intel AVX-512 + AVX-512 BF16, no AMX: the same CPU, oneDNN held', main,
                     {('layer', 'float32'): SAME, ('layer', 'bfloat16'): 'layer_avx512_bf16', ('c4', None): SAME,
                      ('c4_bf16', None): 'c4_bf16_avx512_bf16'}),
           CpuColumn('AVX2 + FMA only: the same CPU, the kernel and the libraries held', main,
                     {('layer', 'float32'): 'layer_avx2', ('c4', None): 'c4_avx2'}, 'x86-64-v3')]
    others = sorted({r.file for r in results() if r.file.startswith(CPU_TABLE + '_') and _parts_of(r)})
    for name in others:
        src = newest(('parts', name.split('.')[0]))
        out.append(CpuColumn(f"{cpu_class(src)}: {str(src.data.get('cpu', '')).replace('(R)', '')}", src, own))
    return out


def _parts() -> Result:
    return newest(('parts', CPU_TABLE))


def _part(name: str) -> Optional[dict]:
    return _parts().data['parts'].get(name)


def _layer_sum(part: dict, key: str, candidate: str) -> Optional[float]:
    sums = part['result']['summed_ratio'].get(key) if part else None
    return sums.get(candidate) if sums else None


def _cpu_cell(column: CpuColumn, row) -> str:
    """A column's cell of ``row``: training step; inference (or eval), the lambda side over its baseline."""
    if column.parts.get(row) == SAME:
        return SAME
    part = column.part(row)
    if part is None:
        return NOT_MEASURED
    if row[1] is not None:  # one layer: benchmark_cpu_isa.py's sums of 'auto' by the column's build
        t, e = (_layer_sum(part, f'{m} {row[1]}', f'auto[{column.target}]') for m in ('train', 'eval'))
        return f'{x(t)}; {x(e)}' if t is not None else NOT_MEASURED
    entry = part['result'][0]
    lam, base = _models(entry)[:2]
    return f"{x(model_ratio(entry, lam, base, 'training step'))}; {x(model_ratio(entry, lam, base, 'inference'))}"


def readme_cpu(page: str) -> Tuple[List[Result], List[str]]:
    """The README's CPU table: lambda side / its baseline, training step / inference, by class of CPU (a column
    each: :func:`cpu_columns`)."""
    columns = cpu_columns()
    out = ['| lambda side / baseline, training step; inference | ' + ' | '.join(c.label for c in columns) + ' |',
           '|---|' + '---|' * len(columns)]
    for label, row in CPU_ROWS:
        out.append(f'| {label} | ' + ' | '.join(_cpu_cell(c, row) for c in columns) + ' |')

    def train(column, dtype):
        return x(_layer_sum(column.part(('layer', dtype)), f'train {dtype}', f'auto[{column.target}]'))

    def kernel(column):  # the kernel's bfloat16 path as the run recorded it
        path = (column.part(('layer', 'bfloat16')) or {}).get('result', {}).get('compute_path', {}).get('bfloat16 s1')
        return f'the kernel: {path[1]}' if path else 'the kernel on AVX-512 BF16'
    main, held, avx2 = columns[:3]
    sentence = (f"What to expect: one lambda layer's training step takes {train(main, 'float32')} its 3x3 conv's in "
                f"float32 and {train(main, 'bfloat16')} under bfloat16 autocast on a CPU with AMX like the first "
                f"column's (oneDNN's bfloat16 convolution runs on AMX; {kernel(main)}), "
                f"{train(held, 'bfloat16')} in bfloat16 on an Intel AVX-512 BF16 CPU without AMX, ")
    for other in columns[3:]:
        sentence += (f"{train(other, 'float32')} in float32 and {train(other, 'bfloat16')} in bfloat16 on an "
                     f"{cpu_class(other.source)} CPU ({kernel(other)}), ")
    sentence += (f"and {train(avx2, 'float32')} in float32 on an AVX2-only CPU (where the layer computes bfloat16 in "
                 "float32 and oneDNN's bfloat16 convolution is its reference code: docs/cpu_bfloat16.md).")
    sources = list({s.name: s for c in columns for s in c.sources()}.values())
    return sources, out + ['', sentence]


def cpu_parts_table(page: str, table: str = CPU_TABLE) -> Tuple[List[Result], List[str]]:
    """What each part of the README's CPU run (``table``: its file's stem) ran: kernel build, ATen, oneDNN's
    convolutions, time, loads."""
    src = newest(('parts', table))
    out = ['| part | what | kernel | ATen | oneDNN convolution, float32 / bfloat16 | seconds | load before, after |',
           '|---|---|---|---|---|---:|---|']
    for name, p in src.data['parts'].items():
        i = p['isa']
        out.append(f"| `{name}` | {p['what']} | {KERNEL_ISA.get(i['kernel_isa'], i['kernel_isa'])} "
                   f"(-march={i['kernel_arch']}) | {i['aten_capability']} | {i.get('conv_float32') or '-'} / "
                   f"{i.get('conv_bfloat16') or 'not oneDNN'} | {p['seconds']:.0f} | {p['load_before'].split()[0]}, "
                   f"{p['load_after'].split()[0]} |")
    for run in src.data.get('runs', []):
        out.append(f"| run of {', '.join(run['parts'])} | `{run['command']}`, {run['date']} | | | | "
                   f"{run['seconds']:.0f} | {run['load_before'].split()[0]}, {run['load_after'].split()[0]} |")
    if src.data.get('note'):
        out += ['', f"Note: {src.data['note']}."]
    return [src], out


# --- the runs' history ----------------------------------------------------------------------------------------------


def headline(result: Result) -> str:
    """One figure that says where a run stood: the lambda side over its baseline, training step (or what the run
    measured instead); '-' for counts and compiles."""
    kind, data = kind_of(result), result.data
    try:
        if kind is None or kind[0] in ('parts', 'launches', 'sm90', 'sweep'):
            return '-'
        if kind[0] == 'models':
            e = data[0]
            if kind[1] in ('compile', 'onnx'):
                a, b = (('LambdaResNet-101 compiled', 'ResNet-RS-101+SE compiled') if kind[1] == 'compile'
                        else ('LambdaResNet-101 legacy', 'ResNet-RS-101+SE legacy'))
                return f"{a} / {b}: {x(med(e['times'][a]) / med(e['times'][b]))}"
            lam, base = _models(e)[:2]
            return f"{lam} / {base}, training step: {x(model_ratio(e, lam, base, 'training step'))}"
        if kind[0] == 'layer':
            rows = data['results']
            summed = sum(r['auto']['ms'] for r in rows) / sum(r['conv3x3']['ms'] for r in rows)
            return f'layer / conv summed: {x(summed)}'
        if kind[0] == 'cpu_isa':
            key = next(k for k in data['summed_ratio'] if 'CPU time' not in k)
            return ', '.join(f'{n} {x(v)}' for n, v in data['summed_ratio'][key].items()
                             if n.startswith('cpu_kernel')) + f' ({key})'
        if kind[0] == 'gpu_check':
            if 'layer_vs_conv' not in data['results']:
                return '-'
            r = (_layer_vs_conv(data, 'triton_tc', 'float32', 8, 'train')
                 or _layer_vs_conv(data, 'tensor_cores', 'float32', 8, 'train'))
            return f'layer / conv, b8 train TF32: {x(r)}' if r else '-'
        if kind[0] == 'host_time':
            row = data['rows'][0]
            return f"layer / conv host time, {row['mode']}: {x(row['ratio'])}" if 'ratio' in row else '-'
        if kind[0] == 'macs':
            return f"c4 bf16 multiply-adds: {x(data['rows'][0]['ratio'])}"
    except (KeyError, IndexError, TypeError, ZeroDivisionError, StopIteration):
        return '-'
    return '-'


def earlier_runs(page: str) -> Tuple[List[Result], List[str]]:
    """Every committed result, newest first, one row per run (the JSON of one date, commit and machine): date, commit,
    machine, its JSON and their headlines."""
    runs: Dict[Tuple[str, str, str], List[Result]] = {}
    for r in results():
        if '#' not in r.name:
            runs.setdefault((str(r.get('date', NOT_RECORDED))[:10], _commit(r), _short(r)), []).append(r)
    out = ['| date | commit | machine | JSON | headline |', '|---|---|---|---|---|']
    for (date, commit, machine), rs in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[1][0].name), reverse=True):
        heads = [h for h in (headline(r) for r in rs) if h != '-']
        out.append(f"| {date} | {commit} | {machine} | {', '.join(_link(r.name, page) for r in rs)} | "
                   f"{'; '.join(heads) or '-'} |")
    return [], out


# ---------------------------------------------------------------------------------------------------------------
# the registry

def of(kind: Tuple, table: Callable[[Result], List[str]]) -> Renderer:
    """A renderer of the newest result of ``kind`` by ``table``."""
    def render(page):
        src = newest(kind)
        return [src], table(src)
    return render


def cpu(comparison: str, size: int, batch: int, dtype: str = 'float32', held: Tuple = ()) -> Tuple:
    """The kind of a benchmark_models.py comparison on a CPU (``held``: the environment a cpu_table.py part set)."""
    return ('models', comparison, size, batch, dtype, 'cpu', held)


# the environments of benchmarks/cpu_table.py's parts that hold the kernel's build or the libraries
HOLD_AVX512_BF16 = (('DNNL_MAX_CPU_ISA', 'AVX512_CORE_BF16'), ('ONEDNN_MAX_CPU_ISA', 'AVX512_CORE_BF16'))
HOLD_AVX2 = (('ATEN_CPU_CAPABILITY', 'avx2'), ('DNNL_MAX_CPU_ISA', 'AVX2'), ('MKL_DEBUG_CPU_TYPE', '5'),
             ('MKL_ENABLE_INSTRUCTIONS', 'AVX2'), ('ONEDNN_MAX_CPU_ISA', 'AVX2'), ('TIMM_LAMBDA_CPU_ARCH', 'x86-64-v3'))

# benchmark_cpu_isa.py --cap-libraries: what it holds to AVX2 (its environment)
CAPS_AVX2 = (('ATEN_CPU_CAPABILITY', 'avx2'), ('DNNL_MAX_CPU_ISA', 'AVX2'), ('MKL_DEBUG_CPU_TYPE', '5'),
             ('MKL_ENABLE_INSTRUCTIONS', 'AVX2'), ('ONEDNN_MAX_CPU_ISA', 'AVX2'))

# page -> block name -> renderer
BLOCKS: Dict[str, Dict[str, Renderer]] = {
    'README.md': {'quickstart': of(('quickstart',), quickstart_table), 'timm': timm_summary, 'cpu': readme_cpu,
                  'gpu': readme_gpu},
    'docs/timm_weights.md': {'timm_models': of(('timm_models', 256), timm_models_table),
                             'timm_models_512': of(('timm_models', 512), timm_models_table),
                             'timm_layers': timm_layers},
    'docs/earlier_runs.md': {'cifar': of(cpu('cifar', 32, 64), models_table), 'compile': compile_table,
                             'onnx': of(('onnx', (224, 512)), onnx_table), 'earlier': earlier_runs},
    'docs/lambda_layer.md': {'sweep23': of(('sweep', 23, 1), sweep_table), 'sweep7': of(('sweep', 7, 4), sweep_table)},
    'docs/small_inputs.md': {'quick_run': of(('quick_run',), quick_run_table)},
    'docs/benchmarks.md': {
        'cpu_parts': cpu_parts_table,
        'cpu_isa': of(('cpu_isa', ('native', 'x86-64-v3'), ('bfloat16', 'float32'), 12, (), 'Intel'), cpu_isa_table),
        'cpu_parts_amd': lambda page: cpu_parts_table(page, CPU_TABLE + '_amd'),
        'backbone': of(cpu('backbone', 1024, 1), models_table),
        'c4': models_settings([('float32', cpu('c4', 512, 1)),
                               ('bfloat16 autocast', cpu('c4', 512, 1, 'bfloat16')),
                               ('bfloat16, oneDNN held to AVX-512 BF16 (no AMX)',
                                cpu('c4', 512, 1, 'bfloat16', HOLD_AVX512_BF16)),
                               ('float32, the AVX2 build, libraries held to AVX2',
                                cpu('c4', 512, 1, 'float32', HOLD_AVX2))]),
        'classification': of(cpu('classification', 224, 2), models_table),
        'layer_train': of(('layer', 1024, 'train', 'float32', 'cpu', ()), layer_table),
        'layer_eval': of(('layer', 1024, 'eval', 'float32', 'cpu', ()), layer_table),
        'host_time': host_time_pairs,
        'forward_walk': forward_walk_table,
        'checkpoint': checkpoint_table,
        'layer_plan': layer_pairs,
        'launches': of(('launches',), launches_table),
        'gpu_layer': of(GPU_LAYER, gpu_layer_table),
        'gpu_models': gpu_models_table,
        'sm90': of(('sm90', '3.8.0'), sm90_table),
        'macs': of(('macs',), macs_table),
    },
    'docs/cpu_bfloat16.md': {
        'cpu_amx': of(('cpu_isa', ('native',), ('bfloat16', 'float32'), 12, (), 'Intel'), cpu_isa_bf16_table),
        'cpu_amx_pairs': cpu_isa_pairs,
        'cpu_amd_pairs': lambda page: cpu_isa_pairs(page, 'AMD'),
        'projection': of(('projection', 'Intel', ()), projection_table),
        'projection_amd': of(('projection', 'AMD', ()), projection_table),
        'projection_avx2': of(('projection', 'AMD', tuple(c for c in CAPS_AVX2 if c[0] != 'MKL_DEBUG_CPU_TYPE')),
                              projection_table),
        'cpu_avx2_bf16': of(('cpu_isa', ('x86-64-v3',), ('bfloat16', 'float32'), 12, CAPS_AVX2, 'AMD'),
                            cpu_isa_dtypes_table),
        'backbone_bf16': of(cpu('backbone', 1024, 1, 'bfloat16'), models_table),
        'backbone_bf16_vdpbf16ps': of(cpu('backbone', 1024, 1, 'bfloat16', (('TIMM_LAMBDA_CPU_BF16', 'avx512_bf16'),)),
                                      models_table),
        'cpu_amd': of(('cpu_isa', ('native',), ('bfloat16', 'float32'), 12, (), 'AMD'), cpu_isa_table),
        'cpu_isa_amd': of(('cpu_isa', ('native', 'x86-64-v3'), ('bfloat16', 'float32'), 12, (), 'AMD',
                           ('table', CPU_TABLE + '_amd')), cpu_isa_table),
        'backbone_amd': models_settings([
            ('float32', cpu('backbone', 1024, 1) + (('table', CPU_TABLE + '_amd'),)),
            ('bfloat16 autocast', cpu('backbone', 1024, 1, 'bfloat16') + (('table', CPU_TABLE + '_amd'),))]),
    },
    'docs/table4.md': {'table4': of(('table4', 2, 224), table4_table)},
    'docs/attention_baselines.md': {'table4_summary': of(('table4', 2, 224), table4_summary)},
}


def render(page: str, renderer: Renderer) -> Tuple[str, str]:
    """``(the JSON the block names, its text)``: the caption line, then the table."""
    sources, lines = renderer(page)
    names = ', '.join(f'docs/results/{s.name}' for s in sources) or 'docs/results/*.json'
    text = '\n'.join(([caption(sources, page), ''] if sources else []) + lines)
    return names, text
