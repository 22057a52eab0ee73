"""Ahead-of-time compile check: every kernel and the rollout program, for H100 and TPU v5e/v6e.

Collects ``cases()`` from every ``kernels_pallas/<op>/aot_cases.py`` and
``fp8rl_jax/<pkg>/aot_cases.py`` and compiles each for its target on this CPU-only machine
(``kernels_pallas/aot.py``): the Mosaic GPU pipeline down to SASS with ptxas' registers and spills,
the full Mosaic TPU compiler, XLA for the fallbacks. Each module's cases run in a worker
subprocess, so a compiler crash or hang costs one case, not the run. Prints a table, writes JSON,
and exits non-zero if any case fails to compile, spills registers, exceeds the SMEM budget, or
(for a ``pallas_*`` impl) compiles without a Pallas kernel.

  .aot/venv/bin/python scripts/aot_check.py             # everything (needs scripts/setup_aot.sh)
  .aot/venv/bin/python scripts/aot_check.py --quick     # jax.export lowering tier, faster
  .aot/venv/bin/python scripts/aot_check.py --op fp8_matmul --target h100
  .venv/bin/python scripts/aot_check.py --list          # the cases, no compile, any venv
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import gc
import glob
import importlib
import importlib.metadata
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kernels_pallas import aot  # noqa: E402

MARK = "@@aot "  # prefix of the worker's protocol lines on stdout (compilers print there too)
DEFAULT_OUT = os.path.join(REPO, "experiments", "results", "aot_check.json")


def case_modules() -> list[str]:
    """Module names of every aot_cases.py under kernels_pallas/ and fp8rl_jax/."""
    paths = sorted(glob.glob(os.path.join(REPO, "kernels_pallas", "*", "aot_cases.py")))
    paths += sorted(glob.glob(os.path.join(REPO, "fp8rl_jax", "*", "aot_cases.py")))
    return [os.path.relpath(p, REPO)[: -len(".py")].replace(os.sep, ".") for p in paths]


def load_cases(module: str) -> list[aot.AotCase]:
    return list(importlib.import_module(module).cases())


def _selected(case: aot.AotCase, ops, targets, matches=()) -> bool:
    return (
        (not ops or case.op in ops)
        and (not targets or case.target in targets)
        and (not matches or any(m in case.key for m in matches))
    )


def sample(cases: list[aot.AotCase], n: int | None) -> list[aot.AotCase]:
    """``n`` evenly spaced cases of each (op, impl, target), the first and the last among them
    (decode and prefill shapes both), in order; all when ``n`` is None."""
    if n is None:
        return cases
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(cases):
        groups.setdefault((c.op, c.impl, c.target), []).append(i)
    keep = set()
    for idx in groups.values():
        m = len(idx)
        picks = (
            range(m) if m <= n else ({0} if n == 1 else {j * (m - 1) // (n - 1) for j in range(n)})
        )
        keep.update(idx[j] for j in picks)
    return [c for i, c in enumerate(cases) if i in keep]


def _record(case: aot.AotCase, status: str, reason: str = "", **extra) -> dict:
    rec = dict(op=case.op, impl=case.impl, target=case.target, label=case.label, key=case.key)
    rec.update(status=status, reason=reason, error=None, compile_s=None, max_registers=None)
    rec.update(spill_bytes=None, smem_bytes=None, num_pallas_kernels=None, kernels=[])
    rec.update(extra)
    return rec


def _reason(case, result, status: str) -> str:
    if status == "no-kernel":
        return f"no Pallas kernel in the compiled program ({case.impl} fell back to XLA?)"
    if status == "spill":
        spilled = [k for k in result.kernels if k.spill_stores + k.spill_loads]
        return "; ".join(
            f"{k.name}: {k.registers} regs, spill stores {k.spill_stores} B, "
            f"loads {k.spill_loads} B"
            for k in spilled
        )
    if status == "smem":
        return f"SMEM {result.max_smem_bytes} B > {aot.H100_SMEM_BYTES} B"
    if status == "no-report":
        return "Mosaic GPU kernels compiled but no ptxas report was dumped (registers unverified)"
    return ""


def run_case(case: aot.AotCase, quick: bool) -> dict:
    """Compiles (or, quick, exports) one case; never raises."""
    t0 = time.perf_counter()
    result, exc = None, None
    try:
        compile_fn = aot.export_for if quick else aot.compile_for
        result = compile_fn(case.target, case.fn, *case.args)
    except Exception as e:  # the compiler's verdict, reported, never fatal
        exc = e
    secs = round(time.perf_counter() - t0, 2)
    status = aot.status_of(case, result, exc)
    if exc is not None:
        return _record(case, status, aot.one_line(exc), error=str(exc)[:4000], compile_s=secs)
    kernels = [dict(dataclasses.asdict(k), smem_bytes=k.smem_bytes) for k in result.kernels]
    return _record(
        case, status, _reason(case, result, status), compile_s=secs, kernels=kernels,
        max_registers=result.max_registers if kernels else None,
        spill_bytes=result.spills if kernels else None,
        smem_bytes=result.max_smem_bytes if kernels else None,
        num_pallas_kernels=result.num_pallas_kernels,
    )  # fmt: skip


def _emit(event: dict) -> None:
    sys.stdout.write(MARK + json.dumps(event) + "\n")
    sys.stdout.flush()


def worker(module: str, keys: list[str], quick: bool) -> None:
    """Runs the named cases of one module, reporting each on stdout (the parent's protocol)."""
    import jax

    by_key = {c.key: c for c in load_cases(module)}
    for key in keys:
        _emit({"event": "start", "key": key})
        _emit({"event": "done", "record": run_case(by_key[key], quick)})
        jax.clear_caches()
        gc.collect()


def _reader(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


def _last_line(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [ln.strip() for ln in f.read().splitlines()[-50:] if ln.strip()]
    return lines[-1][:200] if lines else ""


def _exit_reason(rc: int | None, log: str) -> str:
    how = f"killed by {signal.Signals(-rc).name}" if rc and rc < 0 else f"exit code {rc}"
    last = _last_line(log)
    return f"worker {how}" + (f"; last stderr line: {last}" if last else "")


def _spawn(module: str, keys: list[str], quick: bool, log):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", module]
    cmd += ["--quick"] if quick else []
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
        start_new_session=True, cwd=REPO,
    )  # fmt: skip
    proc.stdin.write(json.dumps(keys))
    proc.stdin.close()
    return proc


def _kill(proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's own process group
    proc.wait()


def _drain(proc, q, records, remaining, timeout: float):
    """Collects the worker's records; returns (key in progress, timed out?, started any?)."""
    current, started = None, False
    while True:
        try:
            line = q.get(timeout=timeout)
        except queue.Empty:
            _kill(proc)
            return current, True, started
        if line is None:
            proc.wait()
            return current, False, started
        if not line.startswith(MARK):
            continue
        event = json.loads(line[len(MARK) :])
        if event["event"] == "start":
            current, started = event["key"], True
        else:
            records[event["record"]["key"]] = event["record"]
            remaining.remove(event["record"]["key"])
            current = None


def run_group(module: str, cases: list[aot.AotCase], quick: bool, timeout: float, log_dir: str):
    """Runs one module's cases in worker subprocesses; a crash or hang costs only that case."""
    by_key = {c.key: c for c in cases}
    remaining, records = [c.key for c in cases], {}
    log_path = os.path.join(log_dir, f"{module}.{cases[0].target}.log")
    with open(log_path, "w") as log:
        while remaining:
            proc = _spawn(module, list(remaining), quick, log)
            q: queue.Queue = queue.Queue()
            threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
            current, timed_out, started = _drain(proc, q, records, remaining, timeout)
            if not remaining:
                break
            log.flush()
            # A worker that died before its first case (an import error) fails all of them.
            bad = [current or remaining[0]] if started or timed_out else list(remaining)
            for key in bad:
                if timed_out:
                    status, why = "timeout", f"no result after {timeout:.0f} s"
                else:
                    status, why = "crash", _exit_reason(proc.returncode, log_path)
                records[key] = _record(by_key[key], status, why)
                remaining.remove(key)
    return [records[c.key] for c in cases]


def _versions() -> dict:
    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    git = ["git", "-C", REPO]
    sha = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return dict(
        git_sha=sha.strip() + ("-dirty" if dirty.stdout.strip() else ""),
        jax=version("jax"), jaxlib=version("jaxlib"),
        jax_cuda12_plugin=version("jax-cuda12-plugin"),
        jax_cuda13_plugin=version("jax-cuda13-plugin"), libtpu=version("libtpu"),
        ptxas=_ptxas_version(), python=sys.version.split()[0],
    )  # fmt: skip


def _ptxas_version() -> str | None:
    """Version of the ptxas Mosaic GPU compiles with: ``bin/ptxas`` under jax's CUDA root (the
    ``nvidia-cuda-nvcc-cu12`` wheel's ``nvidia/cuda_nvcc``, or CUDA 13's ``nvidia/cu13``)."""
    try:
        from jax._src import lib as jax_lib

        root = jax_lib.cuda_path
    except ImportError:
        return None
    exe = os.path.join(root or "", "bin", "ptxas")
    if not root or not os.path.exists(exe):
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    return next((ln.split(",")[-1].strip() for ln in out.splitlines() if "release" in ln), None)


def _smem_cell(rec: dict) -> str:
    if rec["status"] == "smem":
        return "OVER"
    if rec["smem_bytes"] is not None:
        return f"{rec['smem_bytes'] / 1024:.0f}K/227K"
    gpu_kernel = rec["target"] == "h100" and rec["impl"].startswith("pallas")
    return ("ok" if rec["status"] == "ok" else "?") if gpu_kernel else "-"


def print_table(records: list[dict]) -> None:
    head = ("op", "impl", "target", "shape", "status", "regs", "spill B", "SMEM", "s")
    rows = [
        (r["op"], r["impl"], r["target"], r["label"], r["status"],
         "-" if r["max_registers"] is None else str(r["max_registers"]),
         "-" if r["spill_bytes"] is None else str(r["spill_bytes"]),
         _smem_cell(r), "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}")
        for r in records
    ]  # fmt: skip
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'<' if i < 5 else '>'}{w}}}" for i, w in enumerate(widths))
    print(fmt.format(*head))
    for r, row in zip(records, rows, strict=True):
        print(fmt.format(*row))
        if r["status"] != "ok" and r["reason"]:
            print(f"    -> {r['reason']}")


def summarize(records: list[dict]) -> dict:
    counts = {s: sum(r["status"] == s for r in records) for s in aot.STATUSES}
    return {k: v for k, v in counts.items() if v}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="jax.export lowering only (no ptxas)")
    p.add_argument("--op", action="append", default=[], help="only this op (repeatable)")
    p.add_argument("--target", action="append", default=[], choices=aot.TARGETS)
    p.add_argument("--match", action="append", default=[], help="only cases whose key has this")
    p.add_argument(
        "--sample", type=int, default=None, help="N evenly spaced cases per op, impl, target"
    )
    p.add_argument(
        "--kernels-only", action="store_true", help="only kernels_pallas/<op>/aot_cases.py"
    )
    p.add_argument("--list", action="store_true", help="list the cases, compile nothing")
    p.add_argument("--allow-failures", action="store_true", help="exit 0 even if cases fail")
    p.add_argument("--jobs", type=int, default=2, help="worker processes at once")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    p.add_argument("--out", default=None, help=f"JSON path (default {DEFAULT_OUT})")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def collect(
    ops, targets, matches=(), n_sample=None, kernels_only=False
) -> tuple[list[tuple[str, list[aot.AotCase]]], list[dict]]:
    """Selected cases grouped by (module, target), and records for modules that fail to load."""
    groups, broken = [], []
    modules = case_modules()
    if kernels_only:  # the Pallas kernels' own cases, not the model / rollout programs
        modules = [m for m in modules if m.startswith("kernels_pallas.")]
    for module in modules:
        try:
            cases = [c for c in load_cases(module) if _selected(c, ops, targets, matches)]
            cases = sample(cases, n_sample)
        except Exception as e:  # a broken aot_cases.py is one failed row, not a crash
            stub = aot.AotCase(module.split(".")[-2], "-", "-", f"{module}.cases()", None, ())
            broken.append(_record(stub, "fail", aot.one_line(e), error=str(e)[:4000]))
            continue
        for target in aot.TARGETS:
            group = [c for c in cases if c.target == target]
            if group:
                groups.append((module, group))
    return groups, broken


def main(argv=None) -> int:
    args = parse_args(argv)
    aot.prepare_environment()
    if args.worker:
        worker(args.worker, json.load(sys.stdin), args.quick)
        return 0
    groups, broken = collect(args.op, args.target, args.match, args.sample, args.kernels_only)
    keys = [c.key for _, cases in groups for c in cases]
    unmatched = [m for m in args.match if not any(m in k for k in keys)]
    if unmatched:  # a renamed case must not silently drop out of a subset (CI's)
        print(f"aot_check: --match selects no case: {unmatched}", file=sys.stderr)
        return 2
    if args.list:
        for _, cases in groups:
            for c in cases:
                print(c.key)
        print(f"{sum(len(c) for _, c in groups)} cases")
        return 0
    t0 = time.perf_counter()
    log_dir = os.path.join(REPO, ".aot", "logs")
    os.makedirs(log_dir, exist_ok=True)
    # Longest groups first (the rollout programs), so the two workers finish together.
    order = sorted(groups, key=lambda g: (not g[0].startswith("fp8rl_jax"), -len(g[1])))
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {
            id(g): pool.submit(run_group, g[0], g[1], args.quick, args.timeout, log_dir)
            for g in order
        }
        records = broken + [r for g in groups for r in futures[id(g)].result()]
    wall = round(time.perf_counter() - t0, 1)
    print_table(records)
    summary = summarize(records)
    report = dict(
        tier="export" if args.quick else "compile",
        filters=dict(
            op=args.op, target=args.target, match=args.match, sample=args.sample,
            kernels_only=args.kernels_only,
        ),
        wall_s=wall, smem_budget_bytes=aot.H100_SMEM_BYTES, summary=summary, **_versions(),
        cases=records,
    )  # fmt: skip
    out = args.out or (DEFAULT_OUT.replace(".json", "_quick.json") if args.quick else DEFAULT_OUT)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    n_bad = len(records) - summary.get("ok", 0)
    counts = ", ".join(f"{v} {k}" for k, v in summary.items())
    print(f"aot_check ({report['tier']} tier, jax {report['jax']}): {counts}; {wall} s; -> {out}")
    if n_bad and args.allow_failures:
        print(f"aot_check: {n_bad} case(s) not ok, allowed by --allow-failures (temporary)")
        return 0
    return 1 if n_bad else 0


if __name__ == "__main__":
    sys.exit(main())
