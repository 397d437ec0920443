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
        names = global_expert_names(engine.module)
        held = {}
        if not engine.zero_optimization():  # fp32 without ZeRO: torch's optimizer steps the weights themselves
            for name, param in engine.module.named_parameters():
                state = engine.optimizer.state[param]
                held[names.get(name, name)] = {"fp32": param.detach().clone(), "exp_avg": state["exp_avg"],
                                               "exp_avg_sq": state["exp_avg_sq"]}
            return self.write(held)
        # DeepSpeed links each parameter to its moments after the first optimizer step of the first group, when
        # the other groups' moments do not exist yet (their fragments stay empty): linked again now.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
        for name, param in engine.module.named_parameters():  # collective within each parameter's group
            held[names.get(name, name)] = {"fp32": safe_get_full_fp32_param(param),
                                           **{key: safe_get_full_optimizer_state(param, key)
                                              for key in ("exp_avg", "exp_avg_sq")}}
        self.write(held)

    def write(self, held: dict) -> None:
        torch.save(held, os.path.join(self.folder, f"rank{torch.distributed.get_rank()}.pt"))


def dumping(spec: str, main=train.main):
    return functools.partial(main, observers=[OptimizerDump(spec)])
