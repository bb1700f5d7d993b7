"""benchmarks/sim_main_job.py reads a main-job log and simulates each of its modes' rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lightning_vlmbalance import CostModel

ROOT = Path(__file__).resolve().parents[2]


def test_each_mode_of_the_log_gets_its_simulated_row(tmp_path) -> None:
    model = CostModel().to_dict()
    summary = {
        "ranks": 2,
        "modes": {
            mode: {"final_model": model, "waste_frac": 0.2, "optimizer_steps": 4}
            for mode in ("off", "overlap", "auto")
        },
    }
    # off's model was off by 10% (held-out MAPE of its last refit): its times jitter by that
    summary["modes"]["off"]["calibration"] = {"held_out_error": [[3.0, 0.5], [0.2, 0.1]]}
    log = tmp_path / "job.log"
    log.write_text("run 1/3: ...\nSUMMARY_JSON " + json.dumps(summary) + "\n")
    out = subprocess.run(
        [sys.executable, "benchmarks/sim_main_job.py", str(log), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["mode"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])["rows"]}
    assert set(rows) == {"off", "overlap", "auto"}
    for r in rows.values():
        assert 0.0 <= r["simulated_waste"] < 1.0
        assert abs(r["ratio"] - r["simulated_waste"] / 0.2) < 1e-2
    assert rows["overlap"]["simulated_waste"] <= rows["off"]["simulated_waste"] + 1e-9
    assert rows["auto"]["auto_choices"] and rows["off"]["auto_choices"] is None
    off = rows["off"]
    assert abs(off["jitter"] - 0.1 * (3.141592653589793 / 2) ** 0.5) < 1e-4
    assert off["simulated_waste_jittered"] > off["simulated_waste"]  # every meeting waits more
    for r in (rows["overlap"], rows["auto"]):  # no refit: no error known
        assert r["jitter"] == 0 and r["simulated_waste_jittered"] == r["simulated_waste"]
