"""Preference tuning's losses (train.objective dpo, ipo, simpo), with TRL's formulas, on pairs of rows: each
micro-batch holds whole pairs, the chosen answer's row then the rejected one's (data/pairs.py).

With d the log-probability of an answer's tokens summed (dpo) or averaged per token (ipo, simpo), and the
reference's r (dpo, ipo; computed once before training, training/reference.py), a pair's loss is

    dpo     -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z),   z = (d_c - r_c) - (d_r - r_r)
    ipo     (z - 1 / (2 beta))^2,                                          z of per-token means
    simpo   -(1 - eps) log sigmoid(beta z - gamma) - eps ...,              z = d_c - d_r of per-token means

(TRL's DPOTrainer sigmoid and ipo, conservative DPO's label smoothing eps, and CPOTrainer's simpo with
simpo_gamma = gamma), plus sft_weight times the chosen answer's mean loss per token. The loss of a step is the
mean over the pairs of its global batch: every micro-batch holds as many pairs, so DeepSpeed's mean over
micro-batches and data-parallel ranks is that mean. Rewards are beta x (d - r) (simpo: beta x d), as TRL logs them.

The rows' log-probabilities are sums over target tokens, so under sequence parallelism each rank's sum of its slice
is all-reduced (with autograd: the sum's backward all-reduces the gradients, which DeepSpeed's mean over the
sequence ranks then divides back) before the loss, which every rank computes alike.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

from model.sequence_parallel import NO_SEQUENCE_PARALLEL
from model.tensor_parallel import SINGLE
from training.multiple_choice import row_losses
from training.reference import score_rows

OBJECTIVES = ("dpo", "ipo", "simpo")
NEEDS_REFERENCE = ("dpo", "ipo")
# Per-pair figures, summed over a logging interval's pairs and reported as their means.
METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
           "logps_rejected")


@dataclass(frozen=True)
class Objective:
    """The loss of train.objective with the preference.* settings."""
    kind: str
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    sft_weight: float = 0.0

    @property
    def needs_reference(self) -> bool:
        return self.kind in NEEDS_REFERENCE


def pair_losses(objective: Objective, logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor
                ) -> tuple[torch.Tensor, dict]:
    """(each pair's loss, its figures) from rows (chosen, rejected, chosen, ...): their summed log-probabilities
    `logps`, answer tokens `counts`, and the reference's summed log-probabilities."""
    logps, counts, reference = logps.view(-1, 2), counts.view(-1, 2).to(logps.dtype), reference.view(-1, 2)
    beta = objective.beta
    if objective.kind == "simpo":
        rewards = beta * logps / counts
        losses = _smoothed(rewards[:, 0] - rewards[:, 1] - objective.gamma, objective.label_smoothing)
    else:
        ratios = logps - reference.to(logps.dtype)
        rewards = beta * ratios
        if objective.kind == "dpo":
            losses = _smoothed(rewards[:, 0] - rewards[:, 1], objective.label_smoothing)
        else:  # ipo
            per_token = ratios / counts
            losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2
    if objective.sft_weight:
        losses = losses - objective.sft_weight * logps[:, 0] / counts[:, 0]
    rewards = rewards.detach()
    figures = {"rewards_chosen": rewards[:, 0], "rewards_rejected": rewards[:, 1],
               "rewards_margin": rewards[:, 0] - rewards[:, 1],
               "rewards_accuracy": (rewards[:, 0] > rewards[:, 1]).to(rewards.dtype),
               "logps_chosen": logps[:, 0].detach(), "logps_rejected": logps[:, 1].detach()}
    return losses, figures


def _smoothed(margin: torch.Tensor, eps: float) -> torch.Tensor:
    """-log sigmoid(margin), with the chance eps that the pair's preference is the other way round."""
    return -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)


class PreferenceLoss:
    """The engine's loss for pairs: called with a micro-batch's logits and labels (targets, pair_info), where
    pair_info (rows, 2) holds each row's reference log-probability and answer tokens (data/pairs.py). Keeps the
    sums of the figures of every pair it saw, on the device, for `take_metrics`."""

    def __init__(self, objective: Objective, vocab_size: int):
        self.objective, self.vocab_size = objective, vocab_size
        self.tp, self.sp = SINGLE, NO_SEQUENCE_PARALLEL
        self.sums, self.pairs = None, 0

    def step_loss(self, micro_batches: list, driver):
        """The loss function of one step, on the driver's tensor and sequence ranks: the same for every step (each
        micro-batch's pairs weigh alike)."""
        self.tp, self.sp = driver.tp, driver.sp
        return self

    def __call__(self, logits: torch.Tensor, labels: tuple) -> torch.Tensor:
        targets, pair_info = labels
        logps = -row_losses(logits, targets, self.vocab_size, self.tp)
        if self.sp.size > 1:
            logps = differentiable_all_reduce(logps, group=self.sp.group)
        losses, figures = pair_losses(self.objective, logps, pair_info[:, 1], pair_info[:, 0])
        sums = torch.stack([figures[name].sum().double() for name in METRICS])
        self.sums = sums if self.sums is None else self.sums + sums
        self.pairs += len(losses)
        return losses.mean()

    def take_metrics(self, driver) -> dict:
        """Collective: the means of the figures over the pairs of every data-parallel rank since the last call
        (the loss stage's, under a pipeline), on every rank; the sums start again."""
        sums = self.sums if self.sums is not None else torch.zeros(len(METRICS), dtype=torch.float64,
                                                                   device=driver.engine.device)
        totals = torch.cat([sums, torch.tensor([float(self.pairs)], dtype=torch.float64, device=sums.device)])
        totals = driver.from_loss_stage(totals)
        dist.all_reduce(totals, group=driver.data_parallel_group)
        self.sums, self.pairs = None, 0
        values = totals.tolist()
        return {name: value / max(values[-1], 1) for name, value in zip(METRICS, values)}


def pair_metrics(objective: Objective, nll: torch.Tensor, pair_info: torch.Tensor) -> dict:
    """The loss and figures' means of pairs scored without gradients (evaluation): `nll`, each row's summed loss."""
    losses, figures = pair_losses(objective, -nll.double(), pair_info[:, 1], pair_info[:, 0])
    return {"loss": losses.mean().item(), **{name: value.mean().item() for name, value in figures.items()}}


def evaluate_pairs(objective: Objective, driver, data, split: str, windows: int, dp_rank: int, layout, device,
                   vocab_size: int, sp) -> dict:
    """Collective: the loss and figures of the validation set's pairs of `split` (data/pairs.py), on every rank;
    {} for a split without pairs."""
    rows = data.eval_rows(split, windows)
    if rows == 0:
        return {}
    nll = score_rows(driver, data, split, rows, dp_rank, layout, device, vocab_size, sp)
    return pair_metrics(objective, nll.cpu(), torch.from_numpy(data.eval_pair_info(split, windows)))
