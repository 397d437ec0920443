"""The real DeepSpeed engine as the in-process tests build it (a world of one, tests/harness.py one_rank_world): a run
config from sections, the engine train.py would make for a ds_config, and steps on fixed batches."""
import deepspeed
import torch
from omegaconf import OmegaConf

from model import build_model
from model_checks import SMALL_GPT
from training.config import RunConfig
from training.optim import client_schedule, optimizer_and_schedule, param_groups, start_schedule
from training.steps import lm_loss


def run_config(**sections) -> RunConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), sections))


def engine_for(cfg: RunConfig, ds: dict, model=None):
    """What train.py does between the ds_config and the first step."""
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 2,
          "steps_per_print": 10**9, **ds}
    ds.update(optimizer_and_schedule(cfg, ds))
    model = model if model is not None else build_model(SMALL_GPT, seed=1)
    engine, *_ = deepspeed.initialize(model=model, config=ds, lr_scheduler=client_schedule(cfg),
                                      model_parameters=param_groups(model.named_parameters(), cfg.optim.weight_decay))
    start_schedule(engine)
    return engine


def train_steps(engine, steps: int) -> list[float]:
    """The learning rate each step ran at (read before it, as train.py logs it)."""
    lrs = []
    for step in range(steps):
        lrs.append(engine.get_lr()[0])
        idx = torch.randint(0, 65, (2, 17), generator=torch.Generator().manual_seed(step))
        engine.backward(lm_loss(engine(idx[:, :-1]), idx[:, 1:]))
        engine.step()
    return lrs
