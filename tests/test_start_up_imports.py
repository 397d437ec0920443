"""What a process that never compiles leaves unloaded: torch's compiler is seconds of the start of every command
and rank (dynamo about 1.5 s, inductor as much again on a 2-core Xeon), so no command that does not compile
imports it on its own."""
import ast
import subprocess
import sys

from harness import REPO


def printed(code: str):
    """The value of the last line a fresh interpreter prints, running `code` in the repo."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


def test_the_entry_points_import_and_build_on_the_meta_device_without_dynamo():
    """Importing train.py, the commands and the objectives, and building each architecture on the meta device (as
    the commands that count or lay out parameters do), leaves dynamo unloaded (scripts.export's 4.9 s took 3.8 with
    it gone; a training run loads it with torch.optim's first parameter group)."""
    code = ("import torch, train, sample, preflight, scripts.chat, scripts.export, scripts.serve, scripts.memory_plan, "
            "training.objectives.rl, training.steps\n"
            "from model import build_model\n"
            "from training.config import load_run_config\n"
            "for preset in ('quickstart', 'llama_quickstart', 'llama_quickstart_moe', 'encoder_1b'):\n"
            "    with torch.device('meta'):\n"
            "        build_model(load_run_config(f'configs/{preset}.yaml', ['model.vocab_size=65']).model)\n"
            "import sys\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))")
    assert printed(code) == []


def test_an_eager_engine_of_each_zero_stage_and_bf16_steps_without_inductor():
    """DeepSpeed's ZeRO and bf16 optimizers import its Muon while the engine is built, and Muon's module
    torch.compiles its functions as it is imported, which imports inductor. training.engines.initialize imports
    it first with the compiling left to the functions' first call, which no AdamW run makes."""
    # torch.optim loads dynamo, and dynamo inductor's configuration: what the engines add to that is the cost
    code = ("import os, sys, torch, torch._dynamo, deepspeed\n"
            "before = set(sys.modules)\n"
            "from training.engines import initialize\n"
            "os.environ.update(RANK='0', LOCAL_RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT='0')\n"
            "deepspeed.init_distributed()\n"
            "for stage, bf16 in ((0, True), (1, False), (2, False), (3, True)):\n"
            "    model = torch.nn.Linear(4, 4)\n"
            "    ds = {'train_micro_batch_size_per_gpu': 1, 'zero_optimization': {'stage': stage},\n"
            "          'bf16': {'enabled': bf16}, 'optimizer': {'type': 'AdamW', 'params': {'torch_adam': True}}}\n"
            "    engine = initialize(model, model.parameters(), ds)\n"
            "    x = torch.ones(1, 4, dtype=torch.bfloat16 if bf16 else torch.float32)\n"
            "    engine.backward(engine(x).float().sum())\n"
            "    engine.step()\n"
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch._inductor')))")
    assert printed(code) == []
