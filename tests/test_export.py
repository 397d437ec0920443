"""The quickstart's path from a bf16 ZeRO-0 run to transformers and sample.py, and checkpoint files that
pickle arbitrary objects refused by export, sampling and resume before anything unpickles them."""
import json
import os
import shutil
import sys

import pytest
import torch

from harness import BF16, TINY, export, run, sample_py, train_py
from hf_check import assert_export_matches_transformers
from training.checkpoints import checkpoint
from training.checkpoints.export import load_export, load_trained


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, char_data):
    """`python train.py` as the quickstart runs it (one process, ZeRO-0) in bf16, tiny, then exported."""
    out = tmp_path_factory.mktemp("bf16_zero0")
    train_py([f"train.out_dir={out}", f"data.dir={char_data}", *TINY, *BF16,
              "train.max_steps=4", "optim.warmup_steps=1", "optim.lr=3e-3"])
    export(out, "step_000004")
    return out


def test_bf16_export_holds_the_fp32_master_weights_by_name(bf16_run):
    """Each exported tensor is the engine's fp32 master of that name: rounded to bf16 it is the module's
    weight the checkpoint holds under the same name, and it carries precision bf16 cannot."""
    tag_dir = bf16_run / "checkpoints" / "step_000004"
    module = checkpoint.load_state_file(str(tag_dir / "mp_rank_00_model_states.pt"))["module"]
    assert all(t.dtype == torch.bfloat16 for t in module.values())
    _, exported, _ = load_export(str(bf16_run / "export" / "step_000004"))
    assert sorted(exported) == sorted(module)
    finer = 0
    for name, master in exported.items():
        assert master.dtype == torch.float32
        rows = slice(0, 65) if name == "tied_modules.embed.weight" else slice(None)  # padding is not exported
        assert torch.equal(master[rows].bfloat16(), module[name][rows]), name
        finer += int((master[rows] != module[name][rows].float()).sum())
    assert finer > 1000  # fp32 masters, not the bf16 weights widened


def test_bf16_export_loads_in_transformers_and_samples(bf16_run):
    folder = str(bf16_run / "export" / "step_000004")
    assert_export_matches_transformers(folder, tokens=32)
    text = sample_py(["--export", folder, "--max_new_tokens", "20", "--prompt", "KING:"]).stdout
    assert any(line.startswith("KING:") and len(line) >= 20 for line in text.splitlines())


def test_an_export_is_read_at_the_dtype_asked(bf16_run):
    """The server's bf16 reads the export's fp32 masters rounded once, not widened copies of the module's weights."""
    folder = str(bf16_run / "export" / "step_000004")
    _, exported, _ = load_export(folder)
    _, model, _, _ = load_trained(None, None, folder, dtype=torch.bfloat16)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, exported[name].bfloat16()), name


class RunsCode:
    """Unpickling this runs a shell command: what a malicious checkpoint file can do with weights_only=False."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_checkpoint_pickling_an_arbitrary_object_is_refused(bf16_run, tmp_path, char_data):
    copy = tmp_path / "run"
    shutil.copytree(bf16_run, copy, ignore=shutil.ignore_patterns("export"))
    tag_dir = copy / "checkpoints" / "step_000004"
    marker = tmp_path / "code_ran"
    path = tag_dir / "mp_rank_00_model_states.pt"
    saved = checkpoint.load_state_file(str(path))
    torch.save({**saved, "client_state": RunsCode(str(marker))}, path)
    checkpoint.mark_complete(str(tag_dir), json.loads((tag_dir / "run_state.json").read_text()))  # sizes match
    expected = (f"checkpoint file {path} pickles posix.system, which is not a tensor or a setting DeepSpeed saves: "
                f"refused")
    for cmd in ([sys.executable, "-m", "scripts.export", "--out_dir", str(copy)],
                [sys.executable, "sample.py", "--out_dir", str(copy)],
                ["train.py", f"train.out_dir={copy}", f"data.dir={char_data}", *TINY, "train.max_steps=6"]):
        proc = (train_py(cmd[1:], check=False, timeout=120) if cmd[0] == "train.py"
                else run(cmd, check=False, timeout=120))
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    with pytest.raises(Exception, match="Weights only load failed"):  # and our loader alone refuses it too
        checkpoint.load_state_file(str(path))
    assert not marker.exists()
