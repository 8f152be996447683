#!/usr/bin/env python
"""One measurement program of this checkout run on the package of another checkout and on this one, alternated, in
one JSON: the figures before and after a change (issue 58 item 5: "both versions timed back to back").

Each run is a process of ``benchmarks/PROGRAM`` from this checkout with ``PYTHONPATH`` naming the package's checkout:
``--before``'s (its ``timm_lambda`` and its kernel build, by its own ``$TORCH_EXTENSIONS_DIR`` if given) or this one;
the order alternates, before first. Each run's JSON is kept whole under ``runs['before']`` / ``runs['after']``, with
both commits; the programs must accept ``--json`` (and, for an older package, its older names: host_time.py,
forward_walk.py and benchmark_lambda_layer.py fall back to ``impl=`` where ``form=`` is not known).

    python benchmarks/before_after.py --before ../old --runs 6 --json docs/results/host_time_plan.json host_time.py
    python benchmarks/before_after.py --before ../old --runs 2 --json docs/results/detection_shapes_plan.json \\
        benchmark_lambda_layer.py --repeats 5
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from harness.measure import commit, load_average, machine

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def run(program: str, args, checkout: str, env_extra: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, 'result.json')
        env = dict(os.environ, PYTHONPATH=checkout, **env_extra)
        subprocess.run([sys.executable, os.path.join(HERE, program)] + list(args) + ['--json', out], env=env,
                       check=True)
        with open(out) as f:
            return json.load(f)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--before', required=True, help="the older checkout (its timm_lambda is imported from there)")
    p.add_argument('--before-extensions', default=None,
                   help="$TORCH_EXTENSIONS_DIR of the older checkout's kernel build (default: the environment's)")
    p.add_argument('--runs', type=int, default=2, help='runs of each version, alternated')
    p.add_argument('--json', required=True)
    p.add_argument('program', help='a program of benchmarks/ (e.g. host_time.py)')
    p.add_argument('args', nargs=argparse.REMAINDER, help="the program's own arguments")
    a = p.parse_args(argv)
    before = os.path.abspath(a.before)
    before_env = {'TIMM_LAMBDA_COMMIT': commit(before)}
    if a.before_extensions:
        before_env['TORCH_EXTENSIONS_DIR'] = a.before_extensions
    record = dict(command=shlex.join(['python', 'benchmarks/before_after.py'] + list(argv or sys.argv[1:])),
                  date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(),
                  before_commit=before_env['TIMM_LAMBDA_COMMIT'], machine=machine('cpu'),
                  load_before=load_average(), program=a.program, runs={'before': [], 'after': []})
    for i in range(a.runs):
        for side, checkout, env in (('before', before, before_env), ('after', REPO, {})):
            print(f'[before_after] {a.program} {side} {i + 1}/{a.runs}', flush=True)
            record['runs'][side].append(run(a.program, a.args, checkout, env))
    record['load_after'] = load_average()
    with open(a.json, 'w') as f:
        json.dump(record, f, indent=1)


if __name__ == '__main__':
    main()
