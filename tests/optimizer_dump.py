"""An observer for tests/test_moe_universal.py: given to the ranks tests/ranks.py forks when MEGALITE_OPTIMIZER_DUMP
("STEP:FOLDER") is in their environment. After step STEP each rank writes what its engine holds of every
parameter, gathered whole from the ranks that share it out (DeepSpeed's safe_get_full_* functions): the fp32
weight and Adam's moments, an expert's under its global name (a one-rank model's). A checkpoint converted to the
universal format must hold exactly these."""
import functools
import os

import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

import train
from model.moe import global_expert_names
from training.observers import Observer


class OptimizerDump(Observer):
    def __init__(self, spec: str):
        step, self.folder = spec.split(":", 1)
        self.step = int(step)

    def after_step(self, step: int, driver, loss) -> None:
        if step != self.step:
            return
        engine = driver.engine
        # DeepSpeed links each parameter to its moments after the first optimizer step of the first group, when
        # the other groups' moments do not exist yet (their fragments stay empty): linked again now.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
        names = global_expert_names(engine.module)
        held = {}
        for name, param in engine.module.named_parameters():  # collective within each parameter's group
            held[names.get(name, name)] = {"fp32": safe_get_full_fp32_param(param),
                                           **{key: safe_get_full_optimizer_state(param, key)
                                              for key in ("exp_avg", "exp_avg_sq")}}
        torch.save(held, os.path.join(self.folder, f"rank{torch.distributed.get_rank()}.pt"))


def dumping(spec: str, main=train.main):
    return functools.partial(main, observers=[OptimizerDump(spec)])
