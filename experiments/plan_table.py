"""Markdown table of planner results: ``python experiments/plan_table.py BEFORE.json AFTER.json``.

Each file is what ``experiments/plan.py --json`` writes (a list of config x topology records);
rows are config x topology x program with the per-device GiB before and after, whether the
after total fits 90% of HBM, the compile seconds and the layers compiled.
"""

import json
import os
import sys


def _rows(path: str) -> dict:
    with open(path) as f:
        records = json.load(f)
    out = {}
    for r in records:
        name = os.path.basename(r["config"].split(":")[0]).removesuffix(".py")
        for p in r["programs"]:
            out[(name, r["topology"], p["program"])] = (r, p)
    return out


def table(before_path: str, after_path: str) -> str:
    before, after = _rows(before_path), _rows(after_path)
    lines = [
        "| config | topology (mesh) | program | before GiB | after GiB (args + temp) | HBM GiB "
        "| fits | compile s | layers |",
        "|---|---|---|---:|---:|---:|---|---:|---|",
    ]
    for key in sorted(set(before) | set(after)):
        name, topo, program = key
        b = before.get(key, (None, None))[1]
        r, a = after.get(key, (None, None))
        rec = r or before[key][0]
        was = f"{b['total_gib']:,.1f}" if b else "-"
        now = (f"**{a['total_gib']:,.1f}** ({a['argument_gib']:.1f} + {a['temp_gib']:.1f})"
               if a else "-")  # fmt: skip
        fits = ("yes" if a["fits"] else "**no**") if a else "-"
        secs = a["compile_s"] if a else b["compile_s"]
        layers = a["layers"] if a else b["layers"]
        lines.append(
            f"| {name} | {topo} ({rec['mesh']}) | {program} | {was} | {now} | "
            f"{(a or b)['hbm_gib']:.0f} | {fits} | {secs:.0f} | {layers} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(*sys.argv[1:3]))
