"""The losses of online RL (train.objective grpo, rloo), with TRL's formulas (GRPOTrainer, RLOOTrainer 1.16).

A prompt's group of G answers with rewards r_1..r_G gives each answer an advantage

    grpo    A_i = r_i - mean(r)                      rloo    A_i = r_i - mean of the others' r_j
    (rl.scale_rewards=group: divided by the group's standard deviation, Bessel-corrected, + 1e-4)

and each answer token t, with the policy's log-probability p_t, the rollouts' policy's o_t and the starting
model's q_t (all at the sampling temperature), the loss

    -min(ratio_t A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) A) + beta (exp(q_t - p_t) - (q_t - p_t) - 1),
    ratio_t = exp(p_t - o_t)

where o_t = p_t, detached, when a batch of rollouts is trained on once (rl.epochs=1: the ratio is 1 and its
gradient the policy gradient). `dapo` sums it over the global batch's answer tokens and divides by their count;
`grpo` means it over each answer's tokens, then over the answers.
"""
from dataclasses import dataclass

import torch

from model.tensor_parallel import SINGLE, TensorParallel, cross_entropy_rows

STD_EPSILON = 1e-4  # TRL's: a group of equal rewards has advantages 0, not 0 / 0


@dataclass(frozen=True)
class PolicyLoss:
    """The per-token loss of rl.* (the baseline is the objective's name)."""
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def advantages(rewards: torch.Tensor, group_size: int, baseline: str = "grpo", scale: str = "group"
               ) -> torch.Tensor:
    """Each answer's advantage from the rewards of consecutive groups of `group_size` answers to one prompt."""
    grouped = rewards.view(-1, group_size)
    if baseline == "rloo":
        base = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
    else:
        base = grouped.mean(1, keepdim=True)
    out = grouped - base
    if scale == "group":
        out = out / (grouped.std(1, keepdim=True) + STD_EPSILON)
    return out.reshape(-1)


def token_logps(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                tp: TensorParallel = SINGLE) -> torch.Tensor:
    """(rows, T) fp32: each target's log-probability under softmax(logits / temperature) over the `vocab_size`
    real tokens (this tensor rank's slice of the vocabulary under tensor parallelism); 0 where the target is
    IGNORE."""
    flat = logits.reshape(-1, logits.size(-1)).float() / temperature
    start = tp.rank * flat.size(-1)
    padding = torch.arange(start, start + flat.size(-1), device=flat.device) >= vocab_size
    return -cross_entropy_rows(flat.masked_fill(padding, float("-inf")), targets.reshape(-1), tp).view(targets.shape)


def token_losses(loss: PolicyLoss, logps: torch.Tensor, old: torch.Tensor | None, reference: torch.Tensor | None,
                 advantage: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(rows, T) per-token losses and their figures ((rows, T) tensors, detached): `old` None trains on the
    rollouts once (o_t = p_t detached); `advantage` (rows,)."""
    old = logps.detach() if old is None else old
    ratio = torch.exp(logps - old)
    a = advantage[:, None].to(logps.dtype)
    clipped = torch.clamp(ratio, 1 - loss.epsilon, 1 + loss.high)
    per_token = -torch.min(ratio * a, clipped * a)
    figures = {"clipped": (((ratio < 1 - loss.epsilon) & (a < 0)) | ((ratio > 1 + loss.high) & (a > 0))).detach()}
    if loss.beta:
        gap = reference - logps
        kl = torch.exp(gap) - gap - 1
        per_token = per_token + loss.beta * kl
        figures["kl"] = kl.detach()
    return per_token, figures


def reduce(loss: PolicyLoss, per_token: torch.Tensor, mask: torch.Tensor, divisor) -> torch.Tensor:
    """A micro-batch's loss: dapo its sum over answer tokens / `divisor` (the global batch's answer tokens per
    micro-batch and rank: training/steps.py supervised_share); grpo the mean over its answers of each one's mean."""
    mask = mask.to(per_token.dtype)
    if loss.loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (per_token * mask).sum() / divisor
