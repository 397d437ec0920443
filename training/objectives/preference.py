"""Preference tuning (train.objective dpo, ipo, simpo): its losses, with TRL's formulas, on pairs of rows (each
micro-batch holds whole pairs, the chosen answer's row then the rejected one's: data/pairs.py), and the objective
the loop trains with: the loss, its rewards in the progress line, the pairs' evaluation, the reference scored
before step 1.

With d the log-probability of an answer's tokens summed (dpo) or averaged per token (ipo, simpo), and the
reference's r (dpo, ipo; computed once before training, training/objectives/reference.py), a pair's loss is

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

from common.checks import ConfigError
from data.token_data import KIND_WORDS
from model.sequence_parallel import NO_SEQUENCE_PARALLEL
from model.tensor_parallel import SINGLE
from training.evaluation.multiple_choice import row_losses
from training.objectives import reference
from training.objectives.base import Objective

KINDS = ("dpo", "ipo", "simpo")
NEEDS_REFERENCE = ("dpo", "ipo")
# Per-pair figures, summed over a logging interval's pairs and reported as their means.
METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "logps_chosen",
           "logps_rejected")


@dataclass(frozen=True)
class PairLoss:
    """The loss of train.objective with the preference.* settings."""
    kind: str
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    sft_weight: float = 0.0

    @property
    def needs_reference(self) -> bool:
        return self.kind in NEEDS_REFERENCE


def pair_losses(objective: PairLoss, logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor
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


class PreferenceObjective(Objective):
    """The engine's loss for pairs: called with a micro-batch's logits and labels (targets, pair_info), where
    pair_info (rows, 2) holds each row's reference log-probability and answer tokens (data/pairs.py). Keeps the
    sums of the figures of every pair it saw, on the device, for `progress`. `ref_id`: the fingerprint of the
    reference it compares with (training/objectives/reference.py), None for SimPO."""

    def __init__(self, objective: PairLoss, vocab_size: int, ref_id: str | None = None):
        self.objective, self.vocab_size, self.ref_id = objective, vocab_size, ref_id
        self.name = objective.kind
        self.tp, self.sp = SINGLE, NO_SEQUENCE_PARALLEL
        self.sums, self.pairs = None, 0

    def describe(self) -> str:
        o = self.objective
        settings = [f"beta {o.beta:g}"] + ([f"gamma {o.gamma:g}"] if o.kind == "simpo" else []) + \
            ([f"label smoothing {o.label_smoothing:g}"] if o.kind != "ipo" else []) + [f"sft weight {o.sft_weight:g}"]
        compared = "against the reference, train.init_from" if o.needs_reference else "without a reference"
        return f"objective: {o.kind} ({', '.join(settings)}), a mean over the pairs of each global batch, {compared}"

    def prepare(self, run, rank) -> str | None:
        return reference.load_or_score(run, rank, self.ref_id) if self.ref_id else None

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

    def progress(self, driver) -> tuple[dict, str]:
        """Collective: the means of the figures over the pairs of every data-parallel rank since the last call
        (the loss stage's, under a pipeline), on every rank; the sums start again."""
        figures = pair_means(driver, METRICS, self.sums, self.pairs)
        self.sums, self.pairs = None, 0
        return figures, (f" | reward accuracy {figures['rewards_accuracy']:.3f}, margin "
                         f"{figures['rewards_margin']:.4f}")

    def evaluate(self, run, rank, split: str, windows: int) -> dict:
        return evaluate_pairs(self.objective, rank.driver, run.data, split, windows, rank.dp_rank, run.layout,
                              run.device, run.cfg.model.vocab_size, rank.sp)

    def evaluation_text(self, figures: dict) -> str:
        return "".join(f", {split} reward accuracy {figures[f'{split}_rewards_accuracy']:.3f}"
                       for split in ("train", "val") if f"{split}_rewards_accuracy" in figures)

    def record(self) -> dict:
        return {"reference": self.ref_id}


def pair_means(driver, names: tuple, sums: torch.Tensor | None, pairs: int) -> dict:
    """Collective: {name: its mean over the pairs of every data-parallel rank} from this rank's `sums` of the
    figures `names` (None: none seen) over its `pairs` (the loss stage's, under a pipeline), on every rank."""
    if sums is None:
        sums = torch.zeros(len(names), dtype=torch.float64, device=driver.engine.device)
    totals = torch.cat([sums, torch.tensor([float(pairs)], dtype=torch.float64, device=sums.device)])
    totals = driver.from_loss_stage(totals)
    dist.all_reduce(totals, group=driver.data_parallel_group)
    values = totals.tolist()
    return {name: value / max(values[-1], 1) for name, value in zip(names, values)}


def pair_metrics(objective: PairLoss, nll: torch.Tensor, pair_info: torch.Tensor) -> dict:
    """The loss and figures' means of pairs scored without gradients (evaluation): `nll`, each row's summed loss."""
    losses, figures = pair_losses(objective, -nll.double(), pair_info[:, 1], pair_info[:, 0])
    return {"loss": losses.mean().item(), **{name: value.mean().item() for name, value in figures.items()}}


def evaluate_pairs(objective: PairLoss, driver, data, split: str, windows: int, dp_rank: int, layout, device,
                   vocab_size: int, sp) -> dict:
    """Collective: the loss and figures of the validation set's pairs of `split` (data/pairs.py), on every rank;
    {} for a split without pairs."""
    rows = data.eval_rows(split, windows)
    if rows == 0:
        return {"loss": float("nan")}
    nll = reference.score_rows(driver, data, split, rows, dp_rank, layout, device, vocab_size, sp)
    return pair_metrics(objective, nll.cpu(), torch.from_numpy(data.eval_pair_info(split, windows)))


def build(name: str, cfg, data, layout, init_from: str | None, saved: dict | None) -> PreferenceObjective:
    """The objective `name` on the pairs of `data`, with the fingerprint of its reference (checked usable now:
    training/objectives/reference.py) where it compares with one: a resumed run's is the one its checkpoint
    names."""
    if data.KIND != "preference":
        raise ConfigError(f"train.objective={name} trains on preference pairs, but {cfg.data.dir} holds "
                          f"{KIND_WORDS[data.KIND]}; fix: prepare pairs with python -m data.prepare --format "
                          f"preference and point data.dir at them, or leave train.objective unset")
    data.check_micro_batch(layout.micro_batch)
    settings = cfg.preference
    objective = PairLoss(name, settings.beta, settings.label_smoothing, settings.gamma, settings.sft_weight)
    ref_id = None
    if objective.needs_reference:
        if saved is not None:
            ref_id = saved.get("reference")
        elif init_from is None:
            raise ConfigError(f"train.objective={name} compares the model with the one it starts from, but "
                              f"train.init_from is not set; fix: set train.init_from to the fine-tuned model (a "
                              f"folder written by python -m scripts.export), or train.objective=simpo, which needs "
                              f"no reference")
        else:
            ref_id = reference.fingerprint(init_from)
        if ref_id is None:
            raise ConfigError(f"the checkpoint {cfg.train.out_dir} resumes was not trained with "
                              f"train.objective={name} (it names no reference); fix: resume it with its own "
                              f"objective, or start a fresh run in another train.out_dir")
        reference.check_reference(data, ref_id, resuming=saved is not None)
    return PreferenceObjective(objective, cfg.model.vocab_size, ref_id)
