"""The report of ``scripts/gpu_check.sh``: the environment record, and the summary of its stages.

``env --out env.json``: code version, jax/jaxlib/plugin versions, devices, ``nvidia-smi`` fields.
``summarize STAGES_DIR --out-dir DIR``: reads what the stages wrote (``status.tsv``, ``env.json``,
``pytest.xml``, ``bench_*.json`` / ``.md``) and writes ``summary.json`` (all of it) and
``summary.md``: the environment, each stage's status and time, issue 11's targets next to the
measured numbers (PASS / FAIL / MISSING; ``n/a`` off a GPU), the ``pytest -m gpu`` counts and
failures, and every benchmark's own table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from experiments import bench_common as bc  # noqa: E402

SMI_FIELDS = ("name", "driver_version", "memory.total", "clocks.sm", "clocks.max.sm",
              "clocks.mem", "power.limit", "temperature.gpu", "pstate")  # fmt: skip
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "numpy", "ml_dtypes", "pytest")  # fmt: skip
# issue 11's goals: GEMM speedups over BF16, decode attention fraction of HBM peak, rollout speedup
GEMM_M4096, GEMM_DECODE, DECODE_BW, ROLLOUT = 1.5, 1.6, 0.70, 1.4
BENCHES = ("matmul", "quantize", "decode", "rollout", "moe", "engine", "host_sync")


def nvidia_smi() -> dict:
    """The ``SMI_FIELDS`` of GPU 0, or why there are none."""
    q = ",".join(SMI_FIELDS)
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return dict(error=f"{type(e).__name__}: {e}")
    if out.returncode:
        return dict(error=out.stderr.strip()[-500:])
    first = out.stdout.strip().splitlines()[0]
    return dict(zip(SMI_FIELDS, (v.strip() for v in first.split(",")), strict=False))


def env_record() -> dict:
    import jax

    versions = {}
    for p in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[p] = importlib.metadata.version(p)
    return bc.env_meta() | dict(
        packages=versions, devices=[str(d) for d in jax.devices()], nvidia_smi=nvidia_smi(),
        executable=sys.executable,
    )  # fmt: skip


# ------------------------------------------------------------------------------ targets


def _row(what, case, measured, goal, on_gpu, unit="x"):
    if not on_gpu:
        status = "n/a (not a GPU)"
    elif measured is None:
        status = "MISSING"
    else:
        status = "PASS" if measured >= goal else "FAIL"
    return dict(target=what, case=case, measured=measured, goal=goal, unit=unit, status=status)


def matmul_targets(bench: dict | None, on_gpu: bool) -> list[dict]:
    """fp8 GEMM (the target's kernel, FP8 x) over BF16 ``jnp.dot``: >= 1.5x at M = 4096,
    >= 1.6x at M <= 64, per (N, K); at M <= 64 also the GEMM followed by its consumer over BF16's
    (``bench_matmul``'s ``+add`` arms: the rollout program's form)."""
    if not bench:
        return [_row("fp8 GEMM / BF16, M = 4096", "-", None, GEMM_M4096, on_gpu)]
    impl = f"fp8:{bench['meta']['impls'][-1]}"
    out = []
    for r in bench["rows"]:
        if r["impl"] not in (impl, f"{impl}+add") or r["m"] not in (16, 64, 4096):
            continue
        goal = GEMM_M4096 if r["m"] == 4096 else GEMM_DECODE
        what = f"{impl} GEMM / BF16, M {'= 4096' if r['m'] == 4096 else '<= 64'}"
        if r["impl"].endswith("+add"):  # the GEMM and its consumer, as in the rollout program
            what = f"{impl} GEMM + residual add / BF16 + add (in program), M <= 64"
        case = f"M={r['m']} N={r['n']} K={r['k']} ({r['model']} {r['layer']})"
        out.append(_row(what, case, r.get("speedup_vs_bf16"), goal, on_gpu))
    return out or [_row(f"{impl} GEMM / BF16", "no M in {16, 64, 4096}", None, GEMM_M4096, on_gpu)]


def decode_targets(bench: dict | None, on_gpu: bool) -> list[dict]:
    """Decode attention on an FP8 cache (the target's kernel, every slot live): >= 70% of the
    datasheet HBM bandwidth."""
    what = "decode attention GB/s / HBM peak, FP8 cache"
    if not bench:
        return [_row(what, "-", None, DECODE_BW, on_gpu, "of peak")]
    kernel = bench["meta"]["impls"][0]
    out = []
    for r in bench["rows"]:
        if r["impl"] == kernel and r["cache"].startswith("fp8") and r.get("lengths") == "full":
            case = f"{r['model']} B={r['b']} S={r['s']} H/K={r['h']}/{r['k']} {r['cache']} {kernel}"
            out.append(_row(what, case, r.get("hbm_frac"), DECODE_BW, on_gpu, "of peak"))
    return out or [_row(what, "no FP8 row", None, DECODE_BW, on_gpu, "of peak")]


def rollout_targets(bench: dict | None, on_gpu: bool) -> list[dict]:
    """W8A8 + FP8 KV rollout over BF16 tokens/s: >= 1.4x (end to end; the decode loop too)."""
    rows = {r["variant"]: r for r in (bench or {}).get("rows", [])}
    fp8 = rows.get("w8a8_fp8kv", {})
    case = "-"
    if fp8:
        model = bench["meta"]["model"]
        case = f"{model} B={fp8['batch']} P={fp8['prompt_len']} A={fp8['new_tokens']}"
    out = [
        _row("W8A8 + FP8 KV rollout tokens/s / BF16 (end to end)", case,
             fp8.get("speedup_e2e_vs_bf16"), ROLLOUT, on_gpu),
        _row("W8A8 + FP8 KV rollout tokens/s / BF16 (decode loop)", case,
             fp8.get("speedup_decode_vs_bf16"), ROLLOUT, on_gpu),
    ]  # fmt: skip
    if "w8a8" in rows:  # no issue target: performance_anchors.md goal 6 (>= 1.10x)
        w = rows["w8a8"].get("speedup_e2e_vs_bf16")
        out.append(_row("W8A8 rollout tokens/s / BF16 (end to end; anchor goal)", case, w, 1.1,
                        on_gpu))  # fmt: skip
    return out


# ------------------------------------------------------------------------------ reading stages


def read_status(stages: pathlib.Path) -> list[dict]:
    """``status.tsv``: stage, exit code, seconds, budget, note (one line per stage; a line
    without those fields continues the note before it: a multi-line command that ``gpu_check.sh``
    recorded before it flattened notes)."""
    out = []
    path = stages / "status.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.count("\t") < 3:
            if out:
                out[-1]["note"] += " " + line.strip()
            continue
        name, rc, secs, budget, *note = line.split("\t")
        rc = int(rc) if rc.lstrip("-").isdigit() else None
        state = {0: "ok", 124: "TIMEOUT", 137: "TIMEOUT (killed)", None: "skipped"}.get(rc, "FAIL")
        out.append(dict(stage=name, rc=rc, status=state, seconds=float(secs or 0),
                        budget_s=float(budget or 0), note="\t".join(note)))  # fmt: skip
    return out


def read_pytest(path: pathlib.Path) -> dict | None:
    """Counts and failed test ids from a junit XML file."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return dict(error=f"unreadable junit xml: {e}")
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in
              ("tests", "failures", "errors", "skipped")}  # fmt: skip
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in root.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts | dict(failed=failed)


def _load(path: pathlib.Path):
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except json.JSONDecodeError as e:
        return dict(error=f"unreadable {path.name}: {e}")


def summarize(stages: pathlib.Path) -> dict:
    env = _load(stages / "env.json") or {}
    benches = {b: _load(stages / f"bench_{b}.json") for b in BENCHES}
    on_gpu = env.get("platform") == "gpu"
    ok = lambda b: benches[b] if benches[b] and "rows" in benches[b] else None
    targets = (
        matmul_targets(ok("matmul"), on_gpu)
        + decode_targets(ok("decode"), on_gpu)
        + rollout_targets(ok("rollout"), on_gpu)
    )
    return dict(env=env, stages=read_status(stages), pytest=read_pytest(stages / "pytest.xml"),
                targets=targets, benches={k: v for k, v in benches.items() if v})  # fmt: skip


def _fmt(v, unit):
    if v is None:
        return "-"
    return f"{100 * v:.0f}%" if unit == "of peak" else f"{v:.2f}x"


def _env_table(env: dict) -> str:
    smi = env.get("nvidia_smi", {})
    clocks = f"{smi.get('clocks.sm', '-')} (max {smi.get('clocks.max.sm', '-')})"
    rows = [
        ["git sha", env.get("git_sha")],
        ["source hash", env.get("source_hash")],
        ["jax / jaxlib", f"{env.get('jax')} / {env.get('jaxlib')}"],
        ["platform", f"{env.get('platform')} {env.get('platform_version') or ''}"],
        ["driver, SM clock", f"{smi.get('driver_version', '-')}, {clocks}"],
        ["python", env.get("executable")],
    ]
    return bc.md_table(["", ""], rows)


def _stages_table(stages: list[dict]) -> str:
    head = ["stage", "status", "seconds", "budget s", "command / note"]
    keys = ("stage", "status", "seconds", "budget_s", "note")
    return bc.md_table(head, [[x[k] for k in keys] for x in stages])


def _targets_table(targets: list[dict]) -> str:
    head = ["target", "case", "measured", "goal", "status"]
    rows = [
        [t["target"], t["case"], _fmt(t["measured"], t["unit"]), _fmt(t["goal"], t["unit"]),
         t["status"]]
        for t in targets
    ]  # fmt: skip
    return bc.md_table(head, rows)


def markdown(s: dict, stages: pathlib.Path) -> str:
    env = s["env"]
    lines = [
        f"# GPU check: {env.get('device_kind', '?')} ({env.get('time', '?')})\n",
        _env_table(env),
        "## Stages\n",
        _stages_table(s["stages"]),
        "## Targets (issue 11)\n",
        _targets_table(s["targets"]),
    ]
    pt = s["pytest"]
    lines.append("## pytest -m gpu\n")
    if pt is None:
        lines.append("no junit xml (the stage did not run or did not finish)\n")
    elif "error" in pt:
        lines.append(pt["error"] + "\n")
    else:
        lines.append(f"{pt['passed']} passed, {pt['failures']} failed, {pt['errors']} errors, "
                     f"{pt['skipped']} skipped\n")  # fmt: skip
        lines += [f"- FAILED {f}\n" for f in pt["failed"][:30]]
    for b in BENCHES:
        md = stages / f"bench_{b}.md"
        if md.exists():
            lines.append("\n" + md.read_text())
        elif b in s["benches"]:
            lines.append(f"\n## bench_{b}: {len(s['benches'][b].get('rows', []))} rows (JSON)\n")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env", help="write the environment record")
    e.add_argument("--out", required=True)
    m = sub.add_parser("summarize", help="summary.json + summary.md from a stages directory")
    m.add_argument("stages")
    m.add_argument("--out-dir", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "env":
        rec = env_record()
        pathlib.Path(args.out).write_text(json.dumps(rec, indent=1))
        print(json.dumps({k: rec[k] for k in ("device_kind", "jax", "git_sha", "nvidia_smi")}))
        return
    stages, out = pathlib.Path(args.stages), pathlib.Path(args.out_dir)
    s = summarize(stages)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(s, indent=1))
    md = markdown(s, stages)
    (out / "summary.md").write_text(md)
    short = md.split("## pytest -m gpu")[0]  # environment, stages, targets
    print(short + f"(all tables: {out / 'summary.md'}; data: summary.json)")


if __name__ == "__main__":
    main()
