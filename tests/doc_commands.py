"""The command blocks of the README and the docs, run as a newcomer pastes them, one after the other, on a fresh
clone: read from the ```bash blocks of a markdown file, made offline and short where a command would download
or train for minutes, each run with its own output checked against how the docs say it ends.

Shortened only by overrides: a train.py run trains 2 steps (TRAINS_FOR_MINUTES), an evaluation scores the first
examples of each task (`--limit`; `eval.limit` in a train.py run that scores tasks); tinyshakespeare is read from the
shared copy, not downloaded. A server line is started, asked for its model and stopped with Ctrl-C. Run as a
newcomer's shell runs them: DeepSpeed left to find its accelerator itself (no DS_ACCELERATOR), so what it prints on a
machine without a GPU is seen."""
import os
import re
import shlex
import signal
import subprocess
import sys
import time

from harness import REPO, free_port, job_env, release_shm

BIN = os.path.dirname(sys.executable)
SHAKESPEARE = os.environ.get("SHAKESPEARE_TXT") or os.path.join(REPO, "..", "shared", "data", "tinyshakespeare.txt")
# Two steps, each evaluated and saved: a periodic evaluation and save before the last step's, as a long run has.
TRAINS_FOR_MINUTES = ["train.max_steps=2", "train.epochs=null", "train.save_interval=1", "train.eval_interval=1",
                      "train.eval_windows=8", "train.log_interval=1", "sample.max_new_tokens=16"]
EVALUATES_FOR_MINUTES = ["--limit", "40"]
SCORES_FOR_MINUTES = ["eval.limit=40"]
# (how a command starts, what its output holds when it ends as the docs say)
# A command whose output is already there (a doc that follows another in one clone) ends saying so.
DONE = ("wrote ", "nothing to do")
ENDINGS = [
    ("python -m data.prepare", DONE),
    ("python train.py --config configs/llama_quickstart_reward.yaml", "saved step_"),  # a reward model: no sample
    ("python train.py", "--- sample ---"),
    ("deepspeed", "--- sample ---"),
    ("torchrun", "--- sample ---"),
    ("python sample.py", ""),
    ("python -m scripts.export", DONE),
    ("python -m scripts.convert_checkpoint", "wrote "),
    ("python -m scripts.evaluate", "acc"),
    ("python -m scripts.serve", "serving "),
    ("python -m data.reverse_task", DONE),
    ("python -m data.continuation_task", DONE),
]
# What a run prints on a machine without a GPU that no newcomer should read: each was once in every command.
ACCELERATOR = "Setting accelerator to CPU"
NOISE = [ACCELERATOR, "WARNING: step", "document masking: on, but"]
# The `deepspeed` launcher's own two processes (the runner and the node's launcher) import DeepSpeed before any code
# of this repo's: their lines stay (DS_ACCELERATOR=cpu in the shell silences them); its ranks print none.
LAUNCHER_OWN = {ACCELERATOR: 2}


def bash_blocks(path: str, section: str | None = None) -> list[tuple[str | None, list[str]]]:
    """(why it is not run here, or None; its commands) of each ```bash block of a markdown file (under its
    `## section`, if given), comments dropped, continued lines joined. A block that needs what this machine
    lacks (a GPU's worth of a model, a download) follows a `<!-- not run here: why -->` line."""
    with open(os.path.join(REPO, path)) as f:
        text = f.read()
    if section:
        text = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for elsewhere, block in re.findall(r"(?:<!-- not run here: (.*?) -->\n)?```bash\n(.*?)```", text, re.S):
        lines = [line.split("  #", 1)[0].strip() for line in block.replace("\\\n", " ").splitlines()]
        blocks.append((elsewhere or None, [line for line in lines if line]))
    return blocks


def as_typed_here(command: str) -> list[tuple[dict, list[str]]]:
    """(environment assignments, argv) of each part of `command` (split at &&) that a test runs, made offline and
    short."""
    runs = []
    for part in command.split("&&"):
        argv = shlex.split(part)
        env = {}
        while re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # VAR=value python ...
            key, _, value = argv.pop(0).partition("=")
            env[key] = value
        if argv[0] in ("python3", ".", "pip"):
            continue  # the virtual environment and its installs: this suite runs in one
        if argv[:3] == ["python", "-m", "pytest"]:
            continue  # this suite itself
        argv = [SHAKESPEARE if a.endswith("shared/data/tinyshakespeare.txt") else a for a in argv]
        if argv[:3] == ["python", "-m", "data.prepare"] and "--input" not in argv:
            argv += ["--input", SHAKESPEARE]
        if "train.py" in argv:
            argv += TRAINS_FOR_MINUTES
            argv += SCORES_FOR_MINUTES if any(a.startswith("eval.tasks=") for a in argv) else []
        if argv[:3] == ["python", "-m", "scripts.evaluate"]:
            argv += EVALUATES_FOR_MINUTES
        if argv[:3] == ["python", "-m", "scripts.serve"]:
            argv += ["--port", str(free_port())]
        if argv[0] in ("deepspeed", "torchrun"):  # a free port: other jobs of this machine may hold the default
            argv[1:1] = ["--master_port", str(free_port())]
        if argv[0] == "torchrun":  # its logs in the clone, not a folder of /tmp's a run
            argv[1:1] = ["--log-dir", "out/torchrun_logs"]
        argv[0] = sys.executable if argv[0] == "python" else os.path.join(BIN, argv[0])
        runs.append((env, argv))
    return runs


def typed(argv: list[str]) -> str:
    return " ".join(["python" if argv[0] == sys.executable else os.path.basename(argv[0]), *argv[1:]])


def ending(argv: list[str]) -> tuple[str, ...]:
    """The ways the command's output may end, as the docs say (any one)."""
    found = [end for start, end in ENDINGS if typed(argv).startswith(start)]
    assert found, f"a documented command with no expected ending in ENDINGS: {typed(argv)}"
    return found[0] if isinstance(found[0], tuple) else (found[0],)


def newcomer_env(argv: list[str], extra: dict) -> dict:
    env = job_env(extra)  # one thread per rank: a launcher's ranks share this machine's cores
    env.pop("DS_ACCELERATOR", None)  # as a newcomer's shell: DeepSpeed finds no GPU itself (tests/conftest.py sets it)
    if argv[0] == sys.executable:  # one process, which has the cores to itself, as a newcomer's does
        env.pop("OMP_NUM_THREADS")
        env.update({"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]} if "OMP_NUM_THREADS" in os.environ else {})
    return env


def run_as_typed(env: dict, argv: list[str], cwd: str) -> tuple[int, str]:
    """(exit code, stdout and stderr) of one documented command run in `cwd`; a server is started, asked for its
    model and stopped with Ctrl-C."""
    if typed(argv).startswith("python -m scripts.serve"):
        return serve_briefly(argv, cwd, newcomer_env(argv, env))
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600, env=newcomer_env(argv, env))
    for port in re.findall(r"--master_port[= ](\d+)", " ".join(argv)):
        release_shm(port)
    return proc.returncode, proc.stdout + proc.stderr


def serve_briefly(argv: list[str], cwd: str, env: dict) -> tuple[int, str]:
    import httpx

    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=30), proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def check_in_order(commands: list[str], cwd: str) -> None:
    """Every command run one after the other in `cwd`, each ending as the docs say, with no traceback and none of
    the known noise."""
    for command in commands:
        for env, argv in as_typed_here(command):
            code, output = run_as_typed(env, argv, cwd)
            assert code == 0, f"{command}\n{output[-6000:]}"
            assert any(end in output for end in ending(argv)), f"{command}\n{output[-3000:]}"
            assert "Traceback" not in output, f"{command}\n{output[-3000:]}"
            noise = [line for line in output.splitlines() if any(n in line for n in NOISE)]
            if os.path.basename(argv[0]) == "deepspeed":
                for text, count in LAUNCHER_OWN.items():
                    ours = [line for line in noise if text in line]
                    noise = [line for line in noise if text not in line] + ours[count:]
            assert not noise, f"{command}\n{noise}"


def train_settings(argv: list[str]):
    """A train.py line's run config as far as one machine can check it without its data: its settings load, and
    what they ask of their layout holds (the check train.py makes at start, training/startup.py)."""
    from training.config import load_run_config, parse_args, split_overrides
    from training.ds_config import load_ds_config
    from training.startup import check_recompute
    from training.topology import pipeline_settings
    args = parse_args(argv[argv.index("train.py") + 1:])
    run, ds_overrides = split_overrides(args.overrides)
    cfg = load_run_config(os.path.join(REPO, args.config), run)
    ds = load_ds_config(os.path.join(REPO, args.ds_config), ds_overrides)
    check_recompute(pipeline_settings(ds), cfg, ds)
    return cfg
