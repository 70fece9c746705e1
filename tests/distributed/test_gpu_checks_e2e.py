"""benchmarks/gpu_checks.sh on a machine without a GPU, end to end: the checks that need a
device say so, and the CPU mode runs every check.
"""

from __future__ import annotations

import json

from test_gpu_checks import lines_by_check, run_script

ALL = ["env", "precision", "memory", "guard", "sync", "checkpoint", "ranks"]


def test_cpu_mode_runs_every_check_that_applies_and_passes(tmp_path):
    result = run_script("--device", "cpu", "--out", str(tmp_path), timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert lines_by_check(result.stdout) == {name: "PASS" for name in ALL}, result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("SUMMARY --device cpu: 7 PASS, 0 FAIL, 0 SKIP")
    report = json.loads((tmp_path / "gpu_checks.json").read_text())
    figures = {r["name"]: r["figures"] for r in report["results"]}
    # the sync counter is not blind: its control row (a read at every step) was counted
    sync = figures["sync"]
    assert sync["control"]["reads"] >= sync["windows_expected"] > 0
    assert all(sync[row]["reads"] == 0 for row in ("plain", "guard adamw", "guard sgd", "session+poller"))
    # the guard took the device path on the CPU, both optimizer variants, as on a GPU
    assert figures["guard"]["adamw_torch_fused"]["checks"] == "device/found_inf"
    assert figures["guard"]["sgd"]["checks"] == "device/mask"
    assert figures["precision"]["bf16"]["mixed_precision"] == "bf16"
    assert "===== ranks" in (tmp_path / "gpu_checks.log").read_text()
