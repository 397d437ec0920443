"""What the rank server loads before it forks any rank (tests/ranks.py): modules, and compiled ops that a
rank would otherwise import or load on its own at start. Loading only: no thread, process group or tensor
work, which a fork would not carry over."""
import deepspeed  # noqa: F401
import functorch.compile  # noqa: F401  (torch's compiler: ~1.5 s of each rank that compiles, train.compile=true)
import torch
import torch._inductor.compile_fx  # noqa: F401
from deepspeed.accelerator import get_accelerator

import train  # noqa: F401

get_accelerator().create_op_builder("ShareMemCommBuilder").load()  # the CPU all-reduce op (cached after a load)
