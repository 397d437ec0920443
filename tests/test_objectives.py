"""The loop names no objective: one the repo does not ship (tests/toy_objective.py, a new file and a registry line)
trains through train.py unchanged, its loss in the steps, its figures in the progress line and metrics.jsonl, its
start-up line and its record in each checkpoint."""
import json
import sys

from harness import TINY, metrics, run


def test_a_new_objective_is_a_file_and_a_registry_line(tmp_path, char_data):
    proc = run([sys.executable, "tests/toy_objective.py", f"data.dir={char_data}", f"train.out_dir={tmp_path}",
                *TINY, "train.max_steps=3", "train.objective=toy_z"])
    assert "objective: toy_z (next-token, z-loss weight 0.0001)" in proc.stdout
    steps = [m for m in metrics(tmp_path) if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3] and all(m["toy_log_z"] > 0 for m in steps)
    assert all(f"| log Z {m['toy_log_z']:.3f} |" in proc.stdout for m in steps)
    state = json.loads((tmp_path / "checkpoints" / "step_000003" / "run_state.json").read_text())
    assert state["toy"] == "z-loss"
