"""experiments/gpu_report.py's reading of a gpu_check.sh run, and the perf_model stage's handling
of a run the model has no chip for (``gpu_check.sh --quick`` on a CPU)."""

import json

from experiments import gpu_report
from kernels_pallas.perf_model import calibration


def test_status_lines_and_a_note_that_ran_over_lines(tmp_path):
    """One line per stage; a line without the four tab-separated fields (a multi-line command
    that an older gpu_check.sh wrote into the note) continues the note before it."""
    (tmp_path / "status.tsv").write_text(
        "env\t0\t1\t30\tpython gpu_report.py env\n"
        "perf_model\t0\t3\t20\tbash -c \"$0\" -m compare \"$@\"; rc=$?\n"
        '    "$0" -m calibration "$@"\n'
        "autotune\t124\t190\t190\tpython -m kernels_pallas.autotune\n"
        "serve\tskipped\t0\t0\tvLLM not installed\n"
    )  # fmt: skip
    rows = gpu_report.read_status(tmp_path)
    want = [("env", "ok"), ("perf_model", "ok"), ("autotune", "TIMEOUT"), ("serve", "skipped")]
    assert [(r["stage"], r["status"]) for r in rows] == want
    assert rows[1]["note"].endswith('rc=$? "$0" -m calibration "$@"')
    assert rows[2]["seconds"] == 190.0


def test_calibration_skips_bench_files_of_a_device_without_a_model(tmp_path, capsys):
    cpu, h200 = tmp_path / "bench_cpu.json", tmp_path / "bench_h200.json"
    row = dict(model="Qwen3-8B", layer="o_proj", m=16, n=4096, k=4096, impl="bf16", median_us=9.0)
    cpu.write_text(json.dumps(dict(meta=dict(device_kind="cpu"), rows=[row])))
    h200.write_text(json.dumps(dict(meta=dict(device_kind="NVIDIA H200"), rows=[row])))
    keep, notes = calibration.modelled([str(cpu), str(h200)])
    assert keep == [str(h200)] and notes == [f"({cpu}: device cpu: no model)"]
    assert calibration.main([str(cpu)]) == 0 and calibration.main([str(cpu), "--fit"]) == 0
    assert f"({cpu}: device cpu: no model)" in capsys.readouterr().out
