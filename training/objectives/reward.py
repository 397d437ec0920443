"""A reward model (train.objective=reward): a score head (model.head=score) trained on preference pairs with TRL's
RewardTrainer loss, the Bradley-Terry model of which answer is preferred. With r the score of a whole sequence
(prompt and answer), a pair's loss is

    -log sigmoid(r_chosen - r_rejected) + center_rewards x (r_chosen + r_rejected)^2

(TRL's center_rewards_coefficient, preference.center_rewards, 0 by default), meaned over the pairs of the global
batch: every micro-batch holds as many pairs (data/pairs.py), so DeepSpeed's mean over micro-batches and
data-parallel ranks is that mean. Figures: the rewards, their margin and the share of pairs ranked right (chosen
above rejected), in the progress line, metrics.jsonl and each evaluation, as TRL logs them.

A pair dataset's row holds inputs = sequence[:-1] and targets = sequence[1:] (IGNORE on the prompt and the
padding), a language model's view. A reward model reads the whole sequence, so `step_batches` rebuilds it: the
inputs with the last target put back after them, and labels that mark the position each row's score is read at,
transformers' *ForSequenceClassification rule: the last token that is not the pad id (training/checkpoints/hf.py
score_pad_id), which an export's config.json names. The model's output is one score a position (batch, time, 1);
a row's score is its value at the mark. Under sequence parallelism a rank holds the mark or none, so each rank's
sum over its slice is all-reduced (with autograd, as preference.py's log-probabilities). The whole sequence must
fit the window: a dataset prepared with a longer --context is refused at start.
"""
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce

from common.checks import ConfigError
from data.token_data import IGNORE, KIND_WORDS
from model.sequence_parallel import NO_SEQUENCE_PARALLEL, SequenceParallel
from training.checkpoints.hf import score_pad_id
from training.objectives.base import Objective
from training.objectives.preference import pair_means
from training.objectives.reference import gathered_rows

# Per-pair figures, summed over a logging interval's pairs and reported as their means (TRL's accuracy, margin).
METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy")


def reward_losses(scores: torch.Tensor, center_rewards: float = 0.0) -> tuple[torch.Tensor, dict]:
    """(each pair's loss, its figures) from the scores of rows (chosen, rejected, chosen, ...)."""
    pairs = scores.view(-1, 2)
    chosen, rejected = pairs[:, 0], pairs[:, 1]
    losses = -F.logsigmoid(chosen - rejected)
    if center_rewards:
        losses = losses + center_rewards * (chosen + rejected) ** 2
    chosen, rejected = chosen.detach(), rejected.detach()
    return losses, {"rewards_chosen": chosen, "rewards_rejected": rejected, "rewards_margin": chosen - rejected,
                    "rewards_accuracy": (chosen > rejected).to(scores.dtype)}


def score_positions(tokens: torch.Tensor, lengths: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Where each row's score is read: its last position within its first `lengths` tokens that does not hold
    pad_id (0 where every one does), the rule of transformers' *ForSequenceClassification, in its own formula."""
    positions = torch.arange(tokens.size(1), device=tokens.device)
    kept = (tokens != pad_id) & (positions < lengths.unsqueeze(1))
    return (positions * kept).argmax(1)


def whole_sequences(inputs: torch.Tensor, targets: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, marks) of a batch of pair rows: each row's whole sequence (its inputs, the last target after them;
    the padding after it as it was), and a one-hot (batch, time) mark of the position its score is read at. A row
    without targets (a scoring batch's padding) has no mark: its score is 0."""
    valid = targets != IGNORE
    rows = valid.any(1).nonzero().squeeze(1)
    positions = torch.arange(targets.size(1), device=targets.device)
    last_target = torch.where(valid, positions, -1).amax(1)  # the sequence's last token is that target
    tokens = inputs.clone()
    tokens[rows, last_target[rows] + 1] = targets[rows, last_target[rows]]
    marks = torch.zeros_like(tokens)
    marks[rows, score_positions(tokens, last_target + 2, pad_id)[rows]] = 1
    return tokens, marks


def row_scores(outputs: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
    """Each row's score, in fp32: the model's output at its mark (0 for a row without one, or for a sequence rank's
    slice that does not hold it)."""
    return torch.where(marks.bool(), outputs[..., 0].float(), 0.0).sum(1)


def _whole_rows(part: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Collective over the sequence ranks: the whole rows of each rank's slice of them."""
    slices = [torch.empty_like(part) for _ in range(sp.size)]
    dist.all_gather(slices, part.contiguous(), group=sp.group)
    return torch.cat(slices, dim=1)


class RewardObjective(Objective):
    """The engine's loss for a reward model, called with a micro-batch's outputs (batch, time, 1) and marks (the
    labels step_batches made). Keeps the sums of the figures of every pair it saw, on the device, for `progress`."""
    name = "reward"
    head = "score"

    def __init__(self, center_rewards: float, pad_id: int):
        self.center_rewards, self.pad_id = center_rewards, pad_id
        self.sp = NO_SEQUENCE_PARALLEL
        self.sums, self.pairs = None, 0

    def describe(self) -> str:
        return (f"objective: reward (Bradley-Terry: -log sigmoid(r_chosen - r_rejected), center rewards "
                f"{self.center_rewards:g}), a mean over the pairs of each global batch; a row's score is read at its "
                f"last token that is not id {self.pad_id} (the export's pad_token_id)")

    def step_batches(self, step: int, micro_batches: list, driver) -> list:
        """Collective over the sequence ranks: each micro-batch of pair rows as (whole sequences, marks), split as the
        data's were."""
        return [self.reward_batch(inputs, labels[0], driver.sp) for inputs, labels in micro_batches]

    def reward_batch(self, inputs, targets: torch.Tensor, sp: SequenceParallel) -> tuple:
        """A batch of pair rows (inputs, targets) as this rank trains on it: its whole sequences and their marks,
        this rank's slice of them (sequence ranks hand over slices: the whole rows are gathered first)."""
        if sp.size > 1:
            inputs, targets = _whole_rows(inputs[0], sp), _whole_rows(targets, sp)
        return sp.split(*whole_sequences(inputs, targets, self.pad_id))

    def step_loss(self, micro_batches: list, driver):
        self.sp = driver.sp
        return self

    def __call__(self, outputs: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
        scores = row_scores(outputs, marks)
        if self.sp.size > 1:
            scores = differentiable_all_reduce(scores, group=self.sp.group)
        losses, figures = reward_losses(scores, self.center_rewards)
        sums = torch.stack([figures[name].sum().double() for name in METRICS])
        self.sums = sums if self.sums is None else self.sums + sums
        self.pairs += len(losses)
        return losses.mean()

    def progress(self, driver) -> tuple[dict, str]:
        figures = pair_means(driver, METRICS, self.sums, self.pairs)
        self.sums, self.pairs = None, 0
        return figures, (f" | reward accuracy {figures['rewards_accuracy']:.3f}, margin "
                         f"{figures['rewards_margin']:.4f}")

    def evaluate(self, run, rank, split: str, windows: int) -> dict:
        """Collective: the loss and figures' means over the validation set's pairs of `split`, on every rank."""
        data = run.data
        rows = data.eval_rows(split, windows)
        if rows == 0:
            return {"loss": float("nan")}
        batches = [self.reward_batch(inputs, targets, NO_SEQUENCE_PARALLEL) for inputs, targets in
                   data.scoring_batches(split, rows, rank.dp_rank, run.layout, run.device)]
        values = rank.driver.row_values([rank.sp.split(*batch) for batch in batches], row_scores)
        scores = gathered_rows(rank.driver, values, rows, rank.dp_rank, run.layout, rank.sp).cpu()
        losses, figures = reward_losses(scores, self.center_rewards)
        return {"loss": losses.mean().item(), **{name: value.mean().item() for name, value in figures.items()}}

    def evaluation_text(self, figures: dict) -> str:
        return "".join(f", {split} reward accuracy {figures[f'{split}_rewards_accuracy']:.3f}"
                       for split in ("train", "val") if f"{split}_rewards_accuracy" in figures)


def longest_sequence(data) -> int:
    """The most tokens of a sequence (prompt and answer) in either split of a pair dataset."""
    return max(int(np.diff(split.index).max(initial=0)) for split in data.splits.values())


def build(name: str, cfg, data, layout, init_from: str | None, saved: dict | None) -> RewardObjective:
    if data.KIND != "preference":
        raise ConfigError(f"train.objective={name} trains on preference pairs, but {cfg.data.dir} holds "
                          f"{KIND_WORDS[data.KIND]}; fix: prepare pairs with python -m data.prepare --format "
                          f"preference and point data.dir at them")
    data.check_micro_batch(layout.micro_batch)
    if cfg.eval.tasks:
        raise ConfigError(f"eval.tasks scores answers by their log-probabilities, which a reward model (train."
                          f"objective={name}) has none of; fix: leave eval.tasks empty")
    block, longest = cfg.model.block_size, longest_sequence(data)
    if longest > block:
        raise ConfigError(f"{cfg.data.dir} holds sequences of up to {longest:,} tokens, model.block_size={block:,}: "
                          f"a reward model reads each whole sequence (prompt and answer) in one window, one token "
                          f"more than a language model's inputs; fix: prepare the pairs again with --context "
                          f"{block - 1}, or raise model.block_size to {longest}")
    return RewardObjective(cfg.preference.center_rewards, score_pad_id(data.meta))

