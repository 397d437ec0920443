"""The optimizer and schedule of a run (optim.* in the run YAML), handed to DeepSpeed to build."""
import math
from typing import Callable

from deepspeed.runtime.lr_schedules import WarmupCosineLR
from torch.optim.lr_scheduler import LambdaLR

from common.checks import ConfigError
from training.config import RunConfig


def decay_split(named_parameters) -> tuple[list, list]:
    """(name, parameter) pairs split into those with weight decay (matrices: linear weights, embeddings)
    and those without (biases, LayerNorm gains), each in model order: the optimizer's two groups."""
    pairs = [(n, p) for n, p in named_parameters if p.requires_grad]
    # Under ZeRO-3's zero.Init a parameter is already a flat 1-D shard: its real shape is ds_shape.
    is_matrix = {n: len(getattr(p, "ds_shape", p.shape)) >= 2 for n, p in pairs}
    return [(n, p) for n, p in pairs if is_matrix[n]], [(n, p) for n, p in pairs if not is_matrix[n]]


def param_groups(named_parameters, weight_decay: float) -> list[dict]:
    """The two groups, named: DeepSpeed's engine splits a mixture of experts' experts out of each into groups
    of their own (their gradients are averaged over the ranks that hold the same experts), keyed by name."""
    decay, no_decay = decay_split(named_parameters)
    return [{"params": [p for _, p in decay], "weight_decay": weight_decay, "name": "decay"},
            {"params": [p for _, p in no_decay], "weight_decay": 0.0, "name": "no_decay"}]


def optimizer_and_schedule(cfg: RunConfig, ds: dict) -> dict:
    """The run config's AdamW and warmup-cosine schedule, as ds_config sections for DeepSpeed to build (a WSD
    schedule, checked here, is built by `client_schedule` instead)."""
    check_schedule(cfg)
    opt = cfg.optim
    params = {"lr": opt.lr, "betas": [opt.beta1, opt.beta2], "eps": opt.eps, "weight_decay": opt.weight_decay}
    offload = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") != "none"
    if not offload:
        # torch's fused AdamW (a kernel for CPU and GPU since torch 2.4: one pass, no temporaries) instead
        # of DeepSpeed's FusedAdam: no op to JIT-build. Offload keeps DeepSpeedCPUAdam.
        params["torch_adam"] = True
        params["fused"] = True
    # The ranges (lr > 0, 0 <= min_lr <= lr, warmup_steps >= 1) are OptimConfig.check's, at start.
    # DeepSpeed's WarmupCosineLR at iteration i: linear warmup i / warmup (i < warmup), then cosine to
    # min_lr at progress (i - warmup + 1) / (total - warmup). Iteration 0 is the schedule's start (lr 0)
    # and training step k runs at iteration k (start_schedule), so steps 1..max_steps are iterations
    # 1..max_steps of a max_steps + 1 iteration schedule: step 1 takes lr / warmup, the last min_lr.
    warmup, floor = opt.warmup_steps, 0.0
    if warmup == 1:  # DeepSpeed warms up over at least 2 iterations; a floor of 1 makes step 1 the peak
        warmup, floor = 2, 1.0
    schedule = {"total_num_steps": cfg.train.max_steps + 1, "warmup_num_steps": warmup,
                "warmup_type": "linear", "warmup_min_ratio": floor, "cos_min_ratio": opt.min_lr / opt.lr}
    sections = {"optimizer": {"type": "AdamW", "params": params}}
    if opt.schedule == "cosine":
        sections["scheduler"] = {"type": "WarmupCosineLR", "params": schedule}
    return sections


def decay_steps(cfg: RunConfig) -> int:
    """The steps of a WSD schedule's decay: the last optim.decay_fraction of train.max_steps, one at least."""
    return max(1, round(cfg.optim.decay_fraction * cfg.train.max_steps))


def check_schedule(cfg: RunConfig) -> None:
    """A WSD schedule's warmup and decay fit in the run, one after the other (at start, where the ds_config is
    assembled with train.max_steps known)."""
    steps, warmup = cfg.train.max_steps, cfg.optim.warmup_steps
    if cfg.optim.schedule == "wsd" and warmup + decay_steps(cfg) > steps:
        raise ConfigError(f"optim.warmup_steps={warmup} and the WSD decay's {decay_steps(cfg)} steps (optim."
                          f"decay_fraction={cfg.optim.decay_fraction:g} of train.max_steps={steps}) overlap; fix: "
                          f"lower optim.warmup_steps or optim.decay_fraction, or raise train.max_steps")


def wsd_rate(step: int, cfg: RunConfig) -> float:
    """Warmup-stable-decay's learning rate at training step `step` (from 1): linear warmup from 0 (step k of the
    first warmup_steps at lr x k / warmup_steps), optim.lr, then over the last decay_steps from lr to min_lr, the
    last step at min_lr: linearly, as 1 - sqrt(progress), or as a half cosine."""
    opt, steps = cfg.optim, cfg.train.max_steps
    if step <= opt.warmup_steps:
        return opt.lr * step / opt.warmup_steps
    progress = min(1.0, max(0.0, (step - (steps - decay_steps(cfg))) / decay_steps(cfg)))
    left = {"linear": 1 - progress, "sqrt": 1 - math.sqrt(progress),
            "cosine": (1 + math.cos(math.pi * progress)) / 2}[opt.decay_shape]
    return opt.min_lr + (opt.lr - opt.min_lr) * left


class RunSchedule(LambdaLR):
    """torch's LambdaLR whose checkpointed state restores where it is (its iteration), not the rate it multiplies
    (base_lrs): the rate is a closure of the run's own settings, which LambdaLR's state leaves out, so a resumed
    run follows its own optim.* and train.max_steps (a longer stable phase, say), as DeepSpeed's cosine does."""

    def load_state_dict(self, state_dict: dict) -> None:
        base_lrs = self.base_lrs
        super().load_state_dict(state_dict)
        self.base_lrs = base_lrs


def client_schedule(cfg: RunConfig) -> Callable | None:
    """The schedule DeepSpeed builds from the run's hands, not its ds_config: WSD, which DeepSpeed's lr_schedules
    lack (warmup-cosine and warmup-decay have no stable phase), as a RunSchedule on the optimizer DeepSpeed builds;
    None for the cosine. torch's scheduler starts at its iteration 0 where DeepSpeed's starts at -1, so iteration i
    is step i + 1."""
    if cfg.optim.schedule != "wsd":
        return None
    lr = cfg.optim.lr
    return lambda optimizer: RunSchedule(optimizer, lambda iteration: wsd_rate(iteration + 1, cfg) / lr)


def schedule_note(cfg: RunConfig) -> str | None:
    """What the schedule does in a run shorter than its warm-up: the learning rate only rises (DeepSpeed's
    WarmupCosineLR keeps warming up to the last step and never reaches its cosine), said once at start."""
    steps, warmup = cfg.train.max_steps, cfg.optim.warmup_steps
    if steps >= warmup:  # at steps == warmup the last step is the cosine's end: min_lr
        return None
    return (f"schedule: train.max_steps={steps} ends within optim.warmup_steps={warmup}: the learning rate warms up "
            f"to {cfg.optim.lr * steps / warmup:.2e} at step {steps} (optim.lr={cfg.optim.lr:g} x {steps}/{warmup}) "
            f"and never decays; set optim.warmup_steps below train.max_steps for the whole warmup-cosine schedule")


def start_schedule(engine) -> None:
    """Put DeepSpeed's scheduler at iteration 1 for training step 1. It starts at iteration -1 (lr 0)
    and the engine advances it after each optimizer step, so step k would run at iteration k - 2: steps
    1 and 2 at lr 0, and min_lr never reached. A resumed run's checkpoint then restores the iteration
    and the learning rate it had reached. (client_schedule's starts where step 1 runs.)"""
    if isinstance(engine.lr_scheduler, WarmupCosineLR):
        engine.lr_scheduler.step(1)


def rate_from_schedule(engine) -> None:
    """After a checkpoint's load: the optimizer's rate for the next step is the schedule's, recomputed at the
    iteration it restored, not the rate the checkpoint's optimizer state holds (which DeepSpeed loads after the
    schedule's state, and which a resumed run with another optim.lr would otherwise take for its first step)."""
    schedule = engine.lr_scheduler
    if isinstance(schedule, WarmupCosineLR):
        schedule.step(schedule.last_batch_iteration)
    elif isinstance(schedule, LambdaLR):
        schedule.last_epoch -= 1
        schedule.step()
