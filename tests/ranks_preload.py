"""What the rank server loads before it forks any rank (tests/ranks.py): modules, and compiled ops that a
rank would otherwise import or load on its own at start. Loading only: no thread, process group or tensor
work, which a fork would not carry over."""
import deepspeed.ops
import functorch.compile  # noqa: F401  (torch's compiler: ~1.5 s of each rank that compiles, train.compile=true)
import torch
import torch._inductor.compile_fx  # noqa: F401
from deepspeed.accelerator import get_accelerator

import train  # noqa: F401
from common import freeze_imports
from training.config import DEFAULT_CONFIG, load_run_config

get_accelerator().create_op_builder("ShareMemCommBuilder").load()  # the CPU all-reduce op (cached after a load)
# Asked by every rank's process group: DeepSpeed probes which of its ops this machine can build, compiling test
# programs (0.14 s a rank), and keeps the answer.
deepspeed.ops.__compatible_ops__
# OmegaConf's first structured config reads the dataclasses' type hints (0.1 s a rank), then reuses them.
load_run_config(DEFAULT_CONFIG, [])
# What is loaded now lives as long as the server: out of the collector's sight for every rank and tool forked from
# it (0.2 s a rank; train.py's ranks freeze again in run_rank, the tools run through ranks.run_tool do not).
freeze_imports()
