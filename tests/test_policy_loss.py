"""Online RL's loss against TRL's: GRPOTrainer._compute_loss (TRL 1.16) run on the same logits, answers,
advantages, rollout-policy and reference log-probabilities equals training/objectives/policy_loss.py's loss and its
gradient, for both normalizations (dapo, grpo), clipped and not, with and without the KL term; its clipped share
and KL equal TRL's logged figures; the advantages are TRL's formulas (GRPO's group mean and Bessel-corrected
standard deviation, RLOO's leave-one-out mean)."""
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from data.token_data import IGNORE
from training.objectives.policy_loss import PolicyLoss, advantages, reduce, token_logps, token_losses

ROWS, PROMPT, ANSWER, VOCAB, PADDED, TEMPERATURE = 6, 5, 7, 11, 16, 0.7


def batch(seed: int):
    """Logits of rows of prompt and answer (the vocabulary padded to PADDED), and each row's answer: the targets of
    the answer positions, IGNORE elsewhere; answers of several lengths."""
    g = torch.Generator().manual_seed(seed)
    T = PROMPT + ANSWER
    logits = torch.randn(ROWS, T, PADDED, generator=g, dtype=torch.float64)
    answers = torch.randint(0, VOCAB, (ROWS, ANSWER), generator=g)
    lengths = torch.tensor([ANSWER, 3, 5, 1, ANSWER, 4])
    mask = torch.arange(ANSWER)[None] < lengths[:, None]
    targets = torch.full((ROWS, T), IGNORE)
    targets[:, PROMPT - 1:PROMPT - 1 + ANSWER] = torch.where(mask, answers, IGNORE)
    return logits, targets, answers, mask.long()


class Accelerator:
    num_processes, sync_gradients = 1, True

    def gather(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(logits, answers, mask, adv, old, ref, loss: PolicyLoss, num_items):
    """TRL's _compute_loss on a stand-in trainer whose policy log-probabilities are TRL's own (its
    selective_log_softmax of the logits at the sampling temperature, the padding ids cut off)."""
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import selective_log_softmax

    answer_logits = logits[:, PROMPT - 1:PROMPT - 1 + ANSWER, :VOCAB] / TEMPERATURE
    per_token = selective_log_softmax(answer_logits, answers)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (per_token, torch.zeros_like(per_token), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=loss.beta, loss_type=loss.loss_type, epsilon_low=loss.epsilon,
        epsilon_high=loss.high, use_vllm=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=Accelerator(), _entropy_bonus_enabled=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        _metrics={"train": defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(ROWS, PROMPT, dtype=torch.long), "prompt_mask": torch.ones(ROWS, PROMPT),
              "completion_ids": answers, "completion_mask": mask, "advantages": adv,
              "num_items_in_batch": torch.tensor(float(num_items))}
    if old is not None:
        inputs["old_per_token_logps"] = _answer_part(old)
    if ref is not None:
        inputs["ref_per_token_logps"] = _answer_part(ref)
    return GRPOTrainer._compute_loss(trainer, None, inputs), trainer._metrics["train"]


def _answer_part(per_position: torch.Tensor) -> torch.Tensor:
    return per_position[:, PROMPT - 1:PROMPT - 1 + ANSWER]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize("clipped", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_equal_trls(loss_type, clipped, beta):
    logits, targets, answers, mask = batch(seed=1)
    loss = PolicyLoss(loss_type, epsilon=0.2, epsilon_high=0.28, beta=beta)
    g = torch.Generator().manual_seed(2)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0], dtype=torch.float64)
    adv = advantages(rewards, group_size=3)
    with torch.no_grad():
        now = token_logps(logits, targets, VOCAB, TEMPERATURE)
    # a rollout policy a step behind: ratios from 0.5 to 2, many outside the clip
    old = (now + torch.empty_like(now).uniform_(-0.7, 0.7, generator=g)) if clipped else None
    ref = (now + torch.empty_like(now).uniform_(-0.5, 0.5, generator=g)) if beta else None
    num_items = int(mask.sum()) * 3  # a global batch's answer tokens: this micro-batch's share is a third

    ours_logits = logits.clone().requires_grad_()
    logps = token_logps(ours_logits, targets, VOCAB, TEMPERATURE)
    per_token, figures = token_losses(loss, logps, old, ref, adv)
    ours = reduce(loss, per_token, targets != IGNORE, num_items)
    ours.backward()

    theirs_logits = logits.clone().requires_grad_()
    theirs, logged = trl_loss(theirs_logits, answers, mask, adv, old, ref, loss, num_items)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6, rel=1e-6)
    assert torch.allclose(ours_logits.grad, theirs_logits.grad, atol=1e-9)
    answer_tokens = targets != IGNORE
    share = float(figures["clipped"][answer_tokens].double().mean())
    assert share == pytest.approx(logged["clip_ratio/region_mean"][0], abs=1e-7)  # TRL counts in fp32
    assert (share > 0.1) == clipped
    if beta:
        assert float(figures["kl"][answer_tokens].mean()) == pytest.approx(logged["kl"][0], abs=1e-7)


def test_advantages_are_trls_formulas():
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.2, 0.2, 0.2, 0.2, 3.0, -1.0, 0.5, 0.0], dtype=torch.float64)
    grouped = rewards.view(-1, 4)
    mean = grouped.mean(1).repeat_interleave(4)
    std = nanstd(grouped, dim=1).repeat_interleave(4)
    assert torch.allclose(advantages(rewards, 4), (rewards - mean) / (std + 1e-4), atol=1e-12)
    assert torch.allclose(advantages(rewards, 4, scale="none"), rewards - mean, atol=1e-12)
    loo = ((grouped.sum(1, keepdim=True) - grouped) / 3).reshape(-1)
    assert torch.allclose(advantages(rewards, 4, "rloo", "none"), rewards - loo, atol=1e-12)
    assert torch.equal(advantages(rewards, 4)[4:8], torch.zeros(4, dtype=torch.float64))  # equal rewards: no signal
