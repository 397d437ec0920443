"""The README's command blocks, run in order on a fresh copy of the repo as a newcomer types them, each ending as
the README says. Shortened only by overrides where a command trains for minutes (TRAINS_FOR_MINUTES), and run
offline: `python -m data.prepare` reads the shared tinyshakespeare instead of downloading it. What cannot run
on one CPU machine (a cluster's hostfile, 8 GPUs' worth of a 124M model, GPT-2's BPE, which tiktoken downloads)
is in the README's second block, whose lines are checked by what they start (their settings load and their
refusal on a fresh clone names the fix), and tested for real elsewhere (test_multinode.py, test_train.py)."""
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from harness import REPO, free_port, job_env, release_shm

BIN = os.path.dirname(sys.executable)
# Two steps, each evaluated and saved: a periodic evaluation and save before the last step's, as a long run has.
TRAINS_FOR_MINUTES = ["train.max_steps=2", "train.epochs=null", "train.save_interval=1", "train.eval_interval=1",
                      "train.eval_windows=8", "train.log_interval=1", "sample.max_new_tokens=16"]
# (how a command starts, what its output holds when it ends as the README says)
ENDINGS = [
    ("python -m data.prepare", "wrote "),
    ("python train.py", "--- sample ---"),
    ("deepspeed", "--- sample ---"),
    ("torchrun", "--- sample ---"),
    ("python sample.py", ""),
    ("python -m scripts.export", "wrote "),
    ("python -m data.reverse_task", "wrote "),
]


def readme_commands(section: str, blocks: slice = slice(None)) -> list[str]:
    """The commands of the ```bash blocks under the README's `## section` (`blocks` of them), comments dropped,
    continued lines joined."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", body, re.S)[blocks]:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line:
                commands.append(line)
    return commands


def as_typed_here(command: str) -> list[list[str]]:
    """The argv of each part of `command` (split at &&) that this test runs, made offline and short."""
    runs = []
    for part in command.split("&&"):
        argv = shlex.split(part)
        if argv[0] in ("python3", ".", "pip"):
            continue  # the virtual environment and its install: this suite runs in one
        if argv[:3] == ["python", "-m", "pytest"]:
            continue  # this suite itself
        if argv[:3] == ["python", "-m", "data.prepare"] and "--input" not in argv:
            argv += ["--input", os.environ.get("SHAKESPEARE_TXT") or os.path.join(REPO, "..", "shared", "data",
                                                                                    "tinyshakespeare.txt")]
        if "train.py" in argv:
            argv += TRAINS_FOR_MINUTES
        if argv[0] in ("deepspeed", "torchrun"):  # a free port: other jobs of this machine may hold the default
            argv[1:1] = ["--master_port", str(free_port())]
        argv[0] = sys.executable if argv[0] == "python" else os.path.join(BIN, argv[0])
        runs.append(argv)
    return runs


def ending(argv: list[str]) -> str:
    typed = " ".join(["python" if argv[0] == sys.executable else os.path.basename(argv[0]), *argv[1:]])
    found = [end for start, end in ENDINGS if typed.startswith(start)]
    assert found, f"a README command with no expected ending in ENDINGS: {typed}"
    return found[0]


@pytest.fixture(scope="module")
def fresh_clone(tmp_path_factory) -> str:
    """The repo's files as a clone has them: tracked and new ones, nothing ignored (no data/, no out/)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    clone = str(tmp_path_factory.mktemp("clone"))
    for name in files:
        if os.path.isfile(os.path.join(REPO, name)):
            os.makedirs(os.path.dirname(os.path.join(clone, name)), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), os.path.join(clone, name))
    return clone


def run_as_typed(argv: list[str], cwd: str) -> subprocess.CompletedProcess:
    env = job_env()  # one thread per rank: a launcher's ranks share this machine's cores
    if argv[0] == sys.executable:  # one process, which has the cores to itself, as a newcomer's does
        env.pop("OMP_NUM_THREADS")
        env.update({"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]} if "OMP_NUM_THREADS" in os.environ else {})
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600, env=env)
    for port in re.findall(r"--master_port[= ](\d+)", " ".join(argv)):
        release_shm(port)
    return proc


@pytest.mark.launch
def test_the_quickstart_running_and_configuration_blocks_work_in_order(fresh_clone):
    commands = (readme_commands("Quickstart") + readme_commands("Running", blocks=slice(0, 1))
                + readme_commands("Configuration"))
    assert len(commands) >= 5, commands
    for command in commands:
        for argv in as_typed_here(command):
            proc = run_as_typed(argv, fresh_clone)
            assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            assert ending(argv) in proc.stdout + proc.stderr, f"{command}\n{proc.stdout[-3000:]}"
            assert "Traceback" not in proc.stderr, f"{command}\n{proc.stderr[-3000:]}"


def test_the_at_scale_block_names_settings_that_load_and_data_it_prepares():
    """What the second block of the Running section cannot run here is checked as far as one machine can: each
    train.py line's settings load, and its data is what the block (or the quickstart) prepares."""
    from training.config import load_run_config, parse_args, split_overrides
    from training.ds_config import load_ds_config
    commands = readme_commands("Running", blocks=slice(1, 2))
    prepared = {"data/shakespeare_char"}  # the quickstart's
    prepared |= {argv[argv.index("--out_dir") + 1] for argv in map(shlex.split, commands)
                 if argv[:3] == ["python", "-m", "data.prepare"]}
    trains = [argv for argv in map(shlex.split, commands) if "train.py" in argv]
    assert len(trains) >= 3, commands
    for argv in trains:
        args = parse_args(argv[argv.index("train.py") + 1:])
        run, ds = split_overrides(args.overrides)
        cfg = load_run_config(os.path.join(REPO, args.config), run)
        load_ds_config(os.path.join(REPO, args.ds_config), ds)
        assert cfg.data.dir in prepared, f"{' '.join(argv)} trains on {cfg.data.dir}, which no command prepares"
