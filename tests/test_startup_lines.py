"""What a run prints before step 0 (issue 35): a handful of lines saying what matters (the layout, the data,
where the run writes, the model and its size, the precision and peak, notes), the full configuration only with
train.print_config=true and always in out_dir; and a relative data.dir read from a folder other than the
repo's root named by its absolute place, with a fix that works from that folder."""
import json
import os
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

import common.checks
import data.token_data
from common.checks import ConfigError
from data.token_data import TokenData
from harness import TINY, fresh_clone, train_py
from refusals import assert_one_error_line

# What each start-up line begins with, in order, in a fresh one-process run of the quickstart's GPT on
# characters, two steps long (within its 100-step warm-up). On every CPU bf16 "auto" takes fp32 weights for this
# 32-wide model and says why (bf16 arithmetic missing, or the model too narrow to gain from it; with AMX its
# matmuls in bf16).
START_UP = ["topology (one process, no launcher): ", "stage 0: ", "data: ", "out_dir: ", "starting fresh: ",
            "model: ", "bf16 auto: fp32", "schedule: "]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, char_data):
    out = tmp_path_factory.mktemp("short")
    proc = train_py(["--ds_config", "ds_configs/zero0.json", f"train.out_dir={out}", f"data.dir={char_data}", *TINY,
                     "train.max_steps=2"])
    return out, proc


def start_up(proc) -> list[str]:
    """The lines before the step-0 evaluation, on stdout and stderr (ranks share them, as a terminal does)."""
    lines = proc.stdout.split("step 0: ")[0].splitlines()
    return lines + [line for line in proc.stderr.splitlines() if line.strip()]


def test_the_start_up_says_what_matters_in_a_handful_of_lines(short_run, char_data):
    out, proc = short_run
    lines = start_up(proc)
    assert [next((p for p in START_UP if line.startswith(p)), line) for line in lines] == START_UP
    topology, _, data, where, _, model, _, _ = lines
    assert topology.endswith("; world 1 = dp 1 x pp 1; global batch 12 = micro 12 x accum 1 x dp 1; ZeRO-0")
    meta = json.loads(open(os.path.join(char_data, "meta.json")).read())
    assert data == (f"data: {char_data} ({meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens); text, "
                    f"char tokenizer")
    assert where == (f"out_dir: {out}: checkpoints/, metrics.jsonl, config.yaml and ds_config.json (the full "
                     f"configuration; train.print_config=true prints it)")
    assert re.fullmatch(r"model: 30,592 parameters \(gpt: 2 layers, 2 heads, width 32, context 32, vocabulary 65\); "
                        r"384 tokens/step; torch\.\w+; MFU against [\d.e+-]+ TFLOP/s per device \(.+\)", model), model


def test_a_run_within_its_warmup_says_so_once_and_deepspeed_not(short_run):
    output = short_run[1].stdout + short_run[1].stderr
    assert output.count("schedule: train.max_steps=2 ends within optim.warmup_steps=100: the learning rate warms up "
                        "to 6.00e-05 at step 2") == 1
    assert "is less than warmup_num_steps" not in output


def test_the_full_configuration_is_written_always_and_printed_on_request(short_run, tmp_path, char_data):
    out, proc = short_run
    assert "run config:" not in proc.stdout and "ds_config:" not in proc.stdout
    written = OmegaConf.load(out / "config.yaml")
    assert written.train.max_steps == 2 and written.train.print_config is False
    assert json.loads((out / "ds_config.json").read_text())["train_batch_size"] == 12
    proc = train_py(["--ds_config", "ds_configs/zero0.json", f"train.out_dir={tmp_path}", f"data.dir={char_data}",
                     *TINY, "train.max_steps=1", "train.print_config=true", "sample.max_new_tokens=1"])
    printed = proc.stdout.split("step 0: ")[0]
    assert f"run config:\n{(tmp_path / 'config.yaml').read_text()}ds_config:\n" in printed
    assert f"ds_config:\n{(tmp_path / 'ds_config.json').read_text()}layout: world 1" in printed


def test_missing_data_read_from_another_folder_is_named_with_a_fix_that_works_there(tmp_path, shakespeare_path,
                                                                                    monkeypatch):
    """`cd docs && python ../train.py` in a fresh clone: data/shakespeare_char is read from docs/. The error names
    that place, and the command it gives, typed there, prepares the dataset that train.py then opens from there."""
    repo, here = fresh_clone(tmp_path / "clone"), tmp_path / "elsewhere"  # not this checkout: it may hold the data
    here.mkdir()
    proc = subprocess.run([sys.executable, os.path.join(repo, "train.py"), "train.max_steps=1"], cwd=here,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_MODE": "disabled"})
    assert proc.returncode == 2
    command = (f"python {repo}/data/prepare.py --input PATH/TO/text.txt --out_dir data/shakespeare_char")
    assert_one_error_line(proc.stderr, f"no prepared dataset in {here}/data/shakespeare_char (meta.json missing: "
                                       f"data/shakespeare_char is read from the current folder, {here}, not the "
                                       f"repo's root); prepare it with: {command}$", {})
    argv = command.replace("PATH/TO/text.txt", shakespeare_path).split()
    subprocess.run([sys.executable, *argv[1:]], cwd=here, check=True, capture_output=True, timeout=300)
    monkeypatch.chdir(here)
    assert TokenData("data/shakespeare_char", None, 32).meta["vocab_size"] == 65


def test_missing_data_read_from_another_folder_points_at_the_repos_own(tmp_path, monkeypatch):
    """Where the repo's root holds the dataset a relative data.dir names, the fix is to run from there."""
    root = tmp_path / "repo"
    (root / "data" / "chars").mkdir(parents=True)
    (root / "data" / "chars" / "meta.json").write_text("{}")
    (root / "docs").mkdir()
    monkeypatch.setattr(common.checks, "REPO_ROOT", str(root))
    monkeypatch.setattr(data.token_data, "REPO_ROOT", str(root))
    monkeypatch.chdir(root / "docs")
    with pytest.raises(ConfigError) as caught:
        TokenData("data/chars", None, 32)
    assert str(caught.value) == (f"no prepared dataset in {root}/docs/data/chars (meta.json missing: data/chars is "
                                 f"read from the current folder, {root}/docs, not the repo's root); fix: run from the "
                                 f"repo's root, cd {root}, where data/chars is prepared, or give its absolute path, "
                                 f"{root}/data/chars")
    monkeypatch.chdir(root)  # from the root, as ever
    with pytest.raises(ConfigError, match=r"^no prepared dataset in data/nowhere \(meta.json missing\); prepare it "
                                          r"with: python -m data.prepare --input PATH/TO/text.txt --out_dir "
                                          r"data/nowhere$"):
        TokenData("data/nowhere", None, 32)
