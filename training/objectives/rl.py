"""Online RL (train.objective grpo, rloo): each step samples answers to the step's prompts with the policy as it
is (training/rollouts.py), rewards them (training/rewards.py), and trains on them with the clipped policy loss
(training/objectives/policy_loss.py, TRL's formulas).

The prompts come as the data's micro-batches (data/prompt_data.py); `step_batches` turns each into rows of prompt
and answer, micro_batch of them (micro_batch / rl.group_size prompts), which the engine then trains on as any
rows: so accumulation, data parallelism, ZeRO 0-3 and tensor parallelism train them as they train text. Each row's
labels carry its targets (the answer's tokens, IGNORE elsewhere), its advantage, and per token the rollouts'
policy's log-probability (rl.epochs > 1), the starting model's (rl.beta > 0) and the sampler's (for the
mismatch figure). The log-probabilities the loss trains come from the training forward pass, as TRL's do; the
sampler's, through the key/value cache in fp32, are only compared with them.

Refused at start: pipelines and sequence parallelism, whose ranks hold a part of the model or of the sequence
and cannot sample an answer alone (the decoders there run a whole forward pass a token).
"""
import time

import torch
import torch.distributed as dist

from common.checks import ConfigError
from data.token_data import IGNORE, KIND_WORDS
from model import build_model, eager
from model.cpu_attention import float32_matmul_precision
from model.generate import Sampling
from training.objectives.base import Objective
from training.objectives.policy_loss import PolicyLoss, advantages, reduce, token_logps, token_losses
from training.rewards import ModelReward, Reward
from training.rollouts import roll_out
from training.steps import supervised_share

KINDS = ("grpo", "rloo")
# Summed over a logging interval on each rank (host figures of the rollouts, then the loss's device figures).
ROLLOUT_SUMS = ("answers", "reward", "reward_sq", "groups", "no_signal", "answer_tokens", "truncated", "rollout_s",
                "train_s", "steps")
LOSS_SUMS = ("tokens", "clipped", "kl", "mismatch")


class OnlineRL(Objective):
    def __init__(self, name: str, settings, loss: PolicyLoss, reward: Reward, tokenizer, stop_ids: tuple,
                 vocab_size: int, block_size: int, seed: int, init_from: str | None, model_cfg):
        self.name, self.settings, self.loss, self.reward = name, settings, loss, reward
        self.tokenizer, self.vocab_size, self.block_size, self.seed = tokenizer, vocab_size, block_size, seed
        self.init_from, self.model_cfg = init_from, model_cfg
        self.sampling = Sampling(settings.max_new_tokens, settings.temperature, None, settings.top_p, stop_ids)
        self.reference = None
        self.rows, self.tp = None, None
        self.host = dict.fromkeys(ROLLOUT_SUMS, 0.0)
        self.device_sums, self.trained_at = None, None

    def describe(self) -> str:
        s, loss = self.settings, self.loss
        baseline = "the leave-one-out mean" if self.name == "rloo" else "the group's mean"
        scale = ", over its standard deviation" if s.scale_rewards == "group" else ""
        return (f"objective: {self.name}, {s.group_size} answers a prompt (temperature {s.temperature:g}, top_p "
                f"{s.top_p:g}, at most {s.max_new_tokens} tokens) rewarded by "
                f"{s.reward_model or s.reward}, advantages against {baseline}{scale}; {loss.loss_type} loss, clip "
                f"{loss.epsilon:g}-{loss.high:g}, beta {loss.beta:g}, rollouts trained {s.epochs}x")

    def prepare(self, run, rank) -> str | None:
        """The reward model on the run's device, and the starting model, kept frozen beside the policy where the
        loss compares with it (rl.beta > 0): built as this rank's tensor slice, whole on every data-parallel rank
        (under ZeRO-3 too)."""
        self.reward = self.reward.to(run.device)
        if not self.loss.beta:
            return None
        from training.checkpoints import hf  # the checkpoint code imports the objectives' registry
        reference = build_model(self.model_cfg, self.seed, tp=rank.tp)
        hf.load_into(reference, self.init_from, self.model_cfg, rank.tp)
        self.reference = reference.to(run.device).eval().requires_grad_(False)
        return f"reference for the KL term: {self.init_from}, frozen"

    def step_batches(self, step: int, micro_batches: list, driver) -> list:
        now = time.perf_counter()
        if self.trained_at is not None:
            self.host["train_s"] += now - self.trained_at
        self.host["steps"] += 1
        if (step - 1) % self.settings.epochs and self.rows is not None:  # the same rollouts, trained on again
            self.trained_at = time.perf_counter()
            return self.rows
        engine, self.tp = driver.engine, driver.tp
        prompts = [(ids, record) for batch_ids, records in micro_batches for ids, record in zip(batch_ids, records)]
        generators = [torch.Generator().manual_seed(hash((self.seed, record["sample"])) % 2**63)
                      for _, record in prompts]
        rollouts = self._sample(driver, [ids for ids, _ in prompts], self.sampling, self.settings.group_size,
                                generators)
        group = self.settings.group_size
        rewards = torch.tensor(self.reward.many([prompts[i // group][1] for i in range(len(rollouts))],
                                                [self._text(r.answer) for r in rollouts]), dtype=torch.float64)
        self._count(rollouts, rewards)
        advantage = advantages(rewards, self.settings.group_size, self.name, self.settings.scale_rewards).float()
        per_micro = len(rollouts) // len(micro_batches)
        self.rows = [self._rows(driver, rollouts[m * per_micro:(m + 1) * per_micro],
                                advantage[m * per_micro:(m + 1) * per_micro], engine.device)
                     for m in range(len(micro_batches))]
        self.host["rollout_s"] += time.perf_counter() - now
        self.trained_at = time.perf_counter()
        return self.rows

    @torch.no_grad()
    @eager  # growing sequences: every length would be a new graph
    def _sample(self, driver, prompts: list[list[int]], sampling: Sampling, group_size: int, generators) -> list:
        engine = driver.engine
        lockstep = driver.data_parallel_group if engine.zero_optimization_stage() == 3 or engine.has_moe_layers \
            else False
        decoder = driver.decoder(1, self.block_size, (self.vocab_size, None), False, slots=len(prompts) * group_size)
        engine.eval()
        try:
            # A token's matmuls are a few rows each: oneDNN's bf16 mode would convert every weight for each.
            with float32_matmul_precision("highest"):
                return roll_out(decoder, prompts, group_size, sampling, generators, lockstep)
        finally:
            engine.train()

    def _text(self, answer: list[int]) -> str:
        """An answer's text, without the stop id that ended it."""
        return self.tokenizer.decode(answer[:-1] if answer and answer[-1] in self.sampling.stop_ids else answer)

    def _count(self, rollouts: list, rewards: torch.Tensor) -> None:
        groups = rewards.view(-1, self.settings.group_size)
        host = self.host
        host["answers"] += len(rollouts)
        host["reward"] += float(rewards.sum())
        host["reward_sq"] += float((rewards ** 2).sum())
        host["groups"] += len(groups)
        host["no_signal"] += float((groups == groups[:, :1]).all(1).sum())
        host["answer_tokens"] += sum(len(r.answer) for r in rollouts)
        host["truncated"] += sum(r.truncated for r in rollouts)

    def _rows(self, driver, rollouts: list, advantage: torch.Tensor, device) -> tuple:
        """One micro-batch of rows of prompt and answer: (inputs, (targets, advantage, old, reference, sampler))."""
        T = self.block_size
        inputs = torch.zeros((len(rollouts), T), dtype=torch.long)
        targets = torch.full((len(rollouts), T), IGNORE, dtype=torch.long)
        sampler = torch.zeros((len(rollouts), T))
        for i, r in enumerate(rollouts):
            sequence, first = r.prompt + r.answer, len(r.prompt) - 1  # input `first` predicts the answer's first
            inputs[i, :len(sequence) - 1] = torch.tensor(sequence[:-1])
            targets[i, first:len(sequence) - 1] = torch.tensor(r.answer)
            sampler[i, first:len(sequence) - 1] = torch.tensor(r.logps)
        inputs, targets, sampler, advantage = (t.to(device) for t in (inputs, targets, sampler, advantage))
        old = self._logps(driver.engine, inputs, targets) if self.settings.epochs > 1 else sampler.new_zeros(0)
        reference = self._logps(self.reference, inputs, targets) if self.reference is not None else \
            sampler.new_zeros(0)
        return inputs, (targets, advantage, old, reference, sampler)

    @torch.no_grad()
    def _logps(self, model, inputs, targets) -> torch.Tensor:
        training = model.training
        model.eval()
        logps = token_logps(model(inputs), targets, self.vocab_size, self.settings.temperature, self.tp)
        model.train(training)
        return logps

    def step_loss(self, micro_batches: list, driver):
        self.tp = driver.tp
        self.divisor = supervised_share([(inputs, labels[0]) for inputs, labels in micro_batches],
                                        driver.data_parallel_group, driver.engine.dp_world_size) \
            if self.loss.loss_type == "dapo" else None
        return self

    def __call__(self, logits: torch.Tensor, labels: tuple) -> torch.Tensor:
        targets, advantage, old, reference, sampler = labels
        logps = token_logps(logits, targets, self.vocab_size, self.settings.temperature, self.tp)
        per_token, figures = token_losses(self.loss, logps, old if old.numel() else None,
                                          reference if reference.numel() else None, advantage)
        mask = targets != IGNORE
        kl = (figures["kl"] * mask).sum().double() if "kl" in figures else torch.zeros((), dtype=torch.float64,
                                                                                         device=mask.device)
        sums = torch.stack([mask.sum().double(), (figures["clipped"] & mask).sum().double(), kl,
                            ((logps.detach() - sampler).abs() * mask).sum().double()])
        self.device_sums = sums if self.device_sums is None else self.device_sums + sums
        return reduce(self.loss, per_token, mask, self.divisor)

    def progress(self, driver) -> tuple[dict, str]:
        """Collective: the rollouts' and the loss's figures since the last call, over the data-parallel ranks."""
        device = driver.engine.device
        loss_sums = self.device_sums if self.device_sums is not None else \
            torch.zeros(len(LOSS_SUMS), dtype=torch.float64, device=device)
        totals = torch.cat([torch.tensor([self.host[k] for k in ROLLOUT_SUMS], dtype=torch.float64, device=device),
                            loss_sums])
        dist.all_reduce(totals, group=driver.data_parallel_group)
        ranks = dist.get_world_size(driver.data_parallel_group)
        sums = dict(zip(ROLLOUT_SUMS + LOSS_SUMS, totals.tolist()))
        self.host, self.device_sums = dict.fromkeys(ROLLOUT_SUMS, 0.0), None
        answers, steps, tokens = max(sums["answers"], 1), max(sums["steps"] / ranks, 1), max(sums["tokens"], 1)
        mean = sums["reward"] / answers
        figures = {"reward": mean, "reward_std": max(sums["reward_sq"] / answers - mean ** 2, 0.0) ** 0.5,
                   "no_signal_groups": sums["no_signal"] / max(sums["groups"], 1),
                   "answer_tokens": sums["answer_tokens"] / answers, "truncated": sums["truncated"] / answers,
                   "clipped": sums["clipped"] / tokens, "kl": sums["kl"] / tokens,
                   "mismatch": sums["mismatch"] / tokens,
                   "rollout_s": sums["rollout_s"] / ranks / steps, "train_s": sums["train_s"] / ranks / steps}
        share = figures["rollout_s"] / max(figures["rollout_s"] + figures["train_s"], 1e-9)
        return figures, (f" | reward {mean:.3f} ± {figures['reward_std']:.3f}, no signal "
                         f"{figures['no_signal_groups']:.2f}, answer {figures['answer_tokens']:.1f} tok, truncated "
                         f"{figures['truncated']:.2f}, clipped {figures['clipped']:.3f}, kl {figures['kl']:.4f}, "
                         f"mismatch {figures['mismatch']:.1e}, rollouts {figures['rollout_s']:.2f} s/step "
                         f"({100 * share:.0f}%)")

    def evaluate(self, run, rank, split: str, windows: int) -> dict:
        """Collective: the greedy answers to the first `windows` prompts of `split`, each rank its share: their mean
        reward, and pass@1, the share that earns a reward of 1 or more (exact_match: right). The loss is minus the
        mean reward."""
        ids, records = run.data.eval_prompts(split, windows)
        if not ids:
            return {"loss": float("nan")}
        driver = rank.driver
        ranks, me = dist.get_world_size(driver.data_parallel_group), _data_rank(driver)
        share = -(-len(ids) // ranks)
        mine = list(range(me * share, min((me + 1) * share, len(ids))))
        # every rank decodes as many prompts (the last ones' padding unread): lockstep ranks need as many passes
        padded = [ids[i] for i in mine] + [ids[0]] * (share - len(mine))
        greedy = Sampling(self.sampling.max_new_tokens, 0.0, None, 1.0, self.sampling.stop_ids)
        rollouts = self._sample(driver, padded, greedy, 1, [None] * len(padded))[:len(mine)]
        rewards = self.reward.many([records[i] for i in mine], [self._text(r.answer) for r in rollouts])
        totals = torch.tensor([sum(rewards), sum(v >= 1 for v in rewards), len(rewards)], dtype=torch.float64,
                              device=driver.engine.device)
        dist.all_reduce(totals, group=driver.data_parallel_group)
        reward, passed, count = totals.tolist()
        return {"loss": -reward / count, "reward": reward / count, "pass1": passed / count}

    def evaluation_text(self, figures: dict) -> str:
        return "".join(f", {split} pass@1 {figures[f'{split}_pass1']:.3f} (reward {figures[f'{split}_reward']:.3f})"
                       for split in ("train", "val") if f"{split}_pass1" in figures)


def _data_rank(driver) -> int:
    return dist.get_rank(driver.data_parallel_group) if driver.data_parallel_group is not None else dist.get_rank()


def build(name: str, cfg, data, layout, init_from: str | None, saved: dict | None) -> OnlineRL:
    """The objective `name` on the prompts of `data`, its settings checked against the layout and the data."""
    s = cfg.rl
    if data.KIND != "prompts":
        raise ConfigError(f"train.objective={name} samples answers to prompts, but {cfg.data.dir} holds "
                          f"{KIND_WORDS[data.KIND]}; fix: prepare prompts with python -m data.prepare --format "
                          f"prompts and point data.dir at them")
    if layout.pipeline_stages > 1 or layout.sp_size > 1 or layout.tp_sequence:
        what = "pipeline stages" if layout.pipeline_stages > 1 else "sequence-parallel ranks" if layout.sp_size > 1 \
            else "tensor ranks that split the sequence (tensor_sequence_parallel)"
        raise ConfigError(f"train.objective={name} samples answers on every rank through a key/value cache, which "
                          f"{what} cannot (each holds a part of the model or of the sequence); fix: a ds_config "
                          f"without them: data parallelism, ZeRO-3 or tensor parallelism for a larger model")
    if layout.micro_batch % s.group_size:
        raise ConfigError(f"train_micro_batch_size_per_gpu={layout.micro_batch} rows does not hold whole groups of "
                          f"rl.group_size={s.group_size} answers (one prompt's, compared with each other in one "
                          f"micro-batch); fix: a micro-batch that is a multiple of rl.group_size")
    if data.longest + s.max_new_tokens > cfg.model.block_size:
        raise ConfigError(f"the longest prompt of {cfg.data.dir} ({data.longest} tokens) and rl.max_new_tokens="
                          f"{s.max_new_tokens} exceed model.block_size={cfg.model.block_size}; fix: lower "
                          f"rl.max_new_tokens to {cfg.model.block_size - data.longest}, or prepare shorter prompts "
                          f"(--context)")
    if init_from is None and saved is None:
        raise ConfigError(f"train.objective={name} samples answers from the model it trains: start it from a "
                          f"fine-tuned one; fix: set train.init_from to an export (python -m scripts.export)")
    if s.beta and cfg.model.n_experts:
        raise ConfigError("rl.beta > 0 keeps the starting model beside the policy, which is not built for a mixture "
                          "of experts; fix: rl.beta=0")
    if s.epochs > 1 and cfg.train.save_interval % s.epochs:
        raise ConfigError(f"train.save_interval={cfg.train.save_interval} is not a multiple of rl.epochs={s.epochs}: "
                          f"a checkpoint between two steps on one batch of rollouts could not resume them; fix: a "
                          f"multiple of {s.epochs}")
    reward = ModelReward(s.reward_model) if s.reward_model else Reward(s.reward)
    first = data.eval_prompts("train", 1)[1][0]
    reward(first, "")  # a typo in the function, a record it cannot read, a model of other prompts: stop here
    tokenizer = data.tokenizer()
    stops = tuple(i for i in (data.meta.get("chat", {}).get("end_of_turn_id"), tokenizer.eot_id) if i is not None)
    data.sample_groups(s.group_size, s.epochs)
    loss = PolicyLoss(s.loss_type, s.epsilon, s.epsilon_high, s.beta)
    return OnlineRL(name, s, loss, reward, tokenizer, stops, cfg.model.vocab_size, cfg.model.block_size,
                    cfg.train.seed, init_from, cfg.model)
