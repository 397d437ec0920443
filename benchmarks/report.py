"""What every benchmark shares: the checks of its command line and inputs at start, the way its main ends on
bad input, what it records next to its figures (the device, the software and the date), and the markdown
table it prints."""
from __future__ import annotations

import atexit
import datetime
import functools
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING

from common.checks import ConfigError, exit_bad_input, new_output, writable_dir

# torch, DeepSpeed and the training modules are imported where they are used: a bad argument is refused, and
# --help answered, before the seconds those imports take.
if TYPE_CHECKING:
    import torch


def run_main(main) -> None:
    """A benchmark's entry point, ending as train.py ends: bad input (a ConfigError from the checks at start)
    is one `error:` line on stderr and exit 2, before anything is measured; main's return value is the exit code."""
    try:
        code = main()
    except ConfigError as e:
        exit_bad_input(e)
    sys.exit(code)


def run_tool(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(check=True) for a tool that takes the user's settings (train.py, the deepspeed launcher):
    when it refuses them (exit 2, its `error:` line already on stderr) the benchmark ends the same way, not with
    a traceback of its own."""
    proc = subprocess.run(cmd, **kwargs)
    if proc.returncode == 2:
        raise SystemExit(2)
    proc.check_returncode()
    return proc


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The launcher as a module: a wheel installed with --target (a machine without DeepSpeed, see wheelhouse.sh)
# puts no `deepspeed` script beside the interpreter.
DEEPSPEED = [sys.executable, "-m", "deepspeed.launcher.runner"]


def launch_recorded(script: str, name: str, ranks: int, config: str, ds_config: str, settings: list[str],
                    work_dir: str | None) -> dict:
    """A real `deepspeed --num_gpus RANKS` run of train.py under `script`, whose ranks record what it counts
    (run_recorded_rank), one thread per rank: train.py's tokens/s over its timed steps and each rank's last
    recorded step."""
    out_dir = tempfile.mkdtemp(prefix=f"{os.path.splitext(os.path.basename(script))[0]}_{name}_", dir=work_dir)
    record = os.path.join(out_dir, "counts")
    cmd = [*DEEPSPEED, "--num_gpus", str(ranks), os.path.abspath(script), "--record", record, "--",
           "--config", config, "--ds_config", f"ds_configs/{ds_config}", f"train.out_dir={out_dir}", *settings]
    print("deepspeed", " ".join(cmd[len(DEEPSPEED):]), flush=True)
    run_tool(cmd, cwd=REPO, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        tokens_per_s = [r for r in map(json.loads, f) if r.get("tokens_per_s")][-1]["tokens_per_s"]
    per_rank = []
    for rank in range(ranks):
        with open(f"{record}.rank{rank}") as f:
            per_rank.append(json.load(f)[-1])
    return {"tokens_per_s": tokens_per_s, "ranks": per_rank}


def run_recorded_rank(record: str, steps: list, observer) -> None:
    """This rank of a launch_recorded run: train.py with the arguments after `--`, watched by `observer`
    (training/observers.py), `steps` (what it appends to) written to RECORD.rank<RANK> when it ends."""
    import train

    def save() -> None:
        with open(f"{record}.rank{os.environ['RANK']}", "w") as f:
            json.dump(steps, f)

    atexit.register(save)
    sys.argv = [os.path.join(REPO, "train.py"), *sys.argv[sys.argv.index("--") + 1:]]
    train.run_rank(functools.partial(train.main, observers=[observer]))


def at_least(args, low, *names: str) -> None:
    """Counts and sizes on a benchmark's command line (--steps, --nprocs, ...; each item of a list)."""
    for name in names:
        values = getattr(args, name)
        for value in values if isinstance(values, list) else [values]:
            if value < low:
                raise ConfigError(f"--{name}={value}: must be >= {low}; fix: set --{name} to {low} or more")


def results_file(path: str, what: str = "--json") -> str:
    """A results file: a rerun overwrites the last figures (record.sh records under fixed names), so only a path
    that cannot be written is refused."""
    if os.path.isfile(path) and os.access(path, os.W_OK):
        return path
    return new_output(path, f"{what} file", f"give {what} a file path in a folder that exists or can be made",
                      folder=False)


def work_folder(path: str, what: str = "--work_dir") -> str:
    """A folder the runs write fresh subfolders into (earlier runs may be there), made here if missing: the last
    check at start, so that a refused command leaves no folder behind."""
    fix = f"point {what} at a folder you can write to"
    writable_dir(path, what, fix)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # what the permission bits do not tell (a read-only or special file system)
        raise ConfigError(f"{what} {path} cannot be created ({e.strerror}); fix: {fix}") from None
    return path


def load_inputs(config: str, ds_config: str, overrides: list[str], root: str = ""):
    """(run config, ds_config, dataset) checked as train.py checks them, before any measurement: relative paths
    (data.dir too) from `root`, the folder the measured processes run in."""
    from data.token_data import TokenData
    from training.config import load_run_config, split_overrides
    from training.ds_config import load_ds_config

    run_overrides, ds_overrides = split_overrides(overrides)
    cfg = load_run_config(os.path.join(root, config), run_overrides)
    ds = load_ds_config(os.path.join(root, ds_config), ds_overrides)
    sources = [{"dir": s.dir and os.path.join(root, s.dir), "weight": s.weight} for s in cfg.data.sources]
    data = TokenData(os.path.join(root, cfg.data.dir), cfg.data.tokenizer, cfg.model.block_size, sources,
                     cfg.model.document_masking)
    cfg.model.vocab_size = cfg.model.vocab_size or data.meta["vocab_size"]
    data.check_vocab(cfg.model.vocab_size)
    return cfg, ds, data


def device_description(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return f"{cpu} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def first_device() -> torch.device:
    """The first accelerator, else the CPU: the device a one-process benchmark measures."""
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def device_slug() -> str:
    """The first accelerator's (else the CPU's) name as a folder name: benchmarks/results/<slug>/."""
    name = device_description(first_device()).split(" (")[0]
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def environment(device: torch.device) -> dict:
    import deepspeed  # the GPU machine may lack it until its wheel is installed; only needed here
    import torch

    return {"date": datetime.date.today().isoformat(), "device": device_description(device),
            "software": {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                         "python": platform.python_version(), "cuda": torch.version.cuda}}


def print_table(header: list[str], rows: list[list]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
