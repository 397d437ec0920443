"""A run that diverges loses nothing: steps whose loss or gradient norm is not finite, and loss spikes, seen
and acted on without a host synchronization of their own.

Every step adds its verdict to a few scalars on the device (`Watch.observe`); the loop reads them only where it
already reads the loss, at each log interval, and before each save, so a non-finite model is never saved
(`Watch.read`: one all-reduce over the ranks). What the run does then is `train.on_nonfinite`:

    stop     end the job on every rank with one line naming the first bad step and the checkpoint to resume
    skip     go on: a non-finite step's update is never applied (DeepSpeed's ZeRO and 16-bit optimizers skip it
             themselves; torch's fused AdamW skips it on the device through found_inf, which training/steps.py
             gives it under ZeRO-0 in fp32 and ZeRO-1 in bf16); stop after
             train.max_skipped_steps such steps in a row
    rewind   reload the newest checkpoint and go on from it with the batches after those already trained on,
             so the data order moves on past the ones that diverged; stop after train.max_rewinds rewinds

A spike is a finite loss above train.spike_factor times its recent mean (an average over about
train.spike_window steps, of finite losses that were not spikes) and above it by train.spike_min_rise at least:
logged as a warning with its step and, with train.on_spike stop or rewind, acted on as a non-finite step would
be. The rise is an absolute floor beside the ratio: near a loss of 0, where a fine-tuned model's losses sit, a
ratio of 10 is noise (0.003 to 0.03).

The same read carries whether any rank was asked to save and stop (SIGUSR1: training/launch/failure.py), so that
every rank saves at the same step, for no collective of its own.
"""
import os
from dataclasses import dataclass
from typing import Callable

import torch

from training.checkpoints import checkpoint

NONE = 2**62  # "no such step" in the MIN-reduced step slots


class Diverged(Exception):
    """The job stops: the message names the step and the checkpoint to resume from."""


@dataclass
class Verdict:
    """What the steps since the last read did, over every rank."""
    first_bad: int | None  # the first step whose loss or gradient norm was not finite
    bad_steps: int  # steps not finite on some rank (counted on the rank that saw the most)
    longest_streak: int  # the longest run of non-finite steps in a row, this window's included
    spike: int | None  # the first spike's step
    spike_ratio: float  # its loss over the recent mean
    stop_asked: bool = False  # some rank was sent SIGUSR1: save now and stop


class Watch:
    """The device-side record of a rank's steps between two reads."""

    def __init__(self, spike_factor: float, spike_window: int, device: torch.device, spike_min_rise: float = 0.0,
                 stop_asked: Callable[[], bool] = lambda: False):
        self.factor, self.window, self.min_rise = spike_factor, spike_window, spike_min_rise
        self.stop_asked = stop_asked  # this rank's, read on the host
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.mean, self.seen, self.streak, self.asked = zero.clone(), zero.clone(), zero.clone(), zero.clone()
        self._clear(zero)

    def _clear(self, zero: torch.Tensor) -> None:
        self.first_bad, self.spike = zero + NONE, zero + NONE
        self.bad_steps, self.longest, self.ratio = zero.clone(), self.streak.clone(), zero.clone()

    @torch.no_grad()
    def observe(self, step: int, loss: torch.Tensor, update_skipped) -> None:
        """The step's mean loss, still on the device, and whether its update was skipped (a bool DeepSpeed's
        optimizer already read, or a tensor on the device)."""
        loss = loss.detach().double()
        bad = ~torch.isfinite(loss) | update_skipped
        # Python numbers only: a tensor made from the host each step would be a copy to the device.
        self.first_bad = torch.where(bad, self.first_bad.clamp(max=step), self.first_bad)
        self.bad_steps += bad
        self.streak = torch.where(bad, self.streak + 1, 0)
        self.longest = torch.maximum(self.longest, self.streak)
        if not self.factor:
            return
        spike = ~bad & (self.seen >= self.window) & (loss > self.factor * self.mean) & \
            (loss - self.mean > self.min_rise)
        self.ratio = torch.where(spike & (self.spike == NONE), loss / self.mean, self.ratio)
        self.spike = torch.where(spike, self.spike.clamp(max=step), self.spike)
        counted = ~bad & ~spike  # an average of ordinary steps: the running mean, then a moving one
        self.seen += counted
        self.mean = torch.where(counted, self.mean + (loss - self.mean) / self.seen.clamp(1, self.window),
                                self.mean)

    def read(self, loss: torch.Tensor | None = None) -> tuple[Verdict, float | None]:
        """Collective: the verdict over every rank since the last read, which starts a new window, and the mean
        of `loss` over the ranks: one host read for both (the progress line's, docs/performance.md)."""
        # A MAX all-reduce of the slots (the step slots negated, so the maximum is the earliest step) and a SUM
        # of the loss, read back together. A stop asked is filled in on the device, not copied from the host.
        if self.stop_asked():
            self.asked.fill_(1.0)
        slots = torch.stack([-self.first_bad, self.bad_steps, self.longest, -self.spike, self.ratio, self.asked])
        torch.distributed.all_reduce(slots, op=torch.distributed.ReduceOp.MAX)
        if loss is not None:
            loss = loss.detach().double().reshape(1)
            torch.distributed.all_reduce(loss)
            slots = torch.cat([slots, loss / torch.distributed.get_world_size()])
        first_bad, bad_steps, longest, spike, ratio, asked, *mean = slots.tolist()
        self._clear(torch.zeros_like(self.mean))
        return Verdict(None if -first_bad == NONE else int(-first_bad), int(bad_steps), int(longest),
                       None if -spike == NONE else int(-spike), ratio, bool(asked)), (mean[0] if mean else None)


def skip_nonfinite_updates(engine) -> torch.Tensor | None:
    """The found_inf flag (1.0: this step's update was skipped) of an engine whose step torch's fused AdamW skips
    on the device (adjust_engine gives it one: training/steps.py), read after the step; None where DeepSpeed's
    optimizer checks the norm itself and counts its skipped steps."""
    return getattr(engine.optimizer, "found_inf", None)


class Guard:
    """A rank's watch over its steps and the run's policy for what it sees (train.on_nonfinite, train.on_spike)."""

    def __init__(self, train, engine, print0: Callable[[str], None], log, stop_asked: Callable[[], bool]):
        self.cfg, self.engine, self.print0, self.log = train, engine, print0, log
        self.watch = Watch(train.spike_factor, train.spike_window, engine.device, train.spike_min_rise, stop_asked)
        self.root = checkpoint.checkpoint_root(train.out_dir)
        self.rewinds = 0
        self.found_inf = skip_nonfinite_updates(engine)  # None: DeepSpeed's optimizer skips and counts them
        self.skipped_steps = engine.skipped_steps

    def observe(self, step: int, loss: torch.Tensor) -> None:
        """After each training step: its mean loss, still on the device."""
        if self.found_inf is not None:
            skipped = self.found_inf > 0
        else:
            skipped, self.skipped_steps = self.engine.skipped_steps > self.skipped_steps, self.engine.skipped_steps
        self.watch.observe(step, loss, skipped)

    def act(self, verdict: Verdict, step: int, batches_skipped: int) -> tuple[int, int] | None:
        """Collective (every rank has the same verdict), at a read point after `step`: None goes on; else (the
        step rewound to, the batches skipped from now on). A stop raises Diverged."""
        if verdict.spike is not None:
            self.print0(f"WARNING: step {verdict.spike}: a loss spike, {verdict.spike_ratio:.1f}x the recent mean "
                        f"(train.spike_factor {self.cfg.spike_factor:g}, train.spike_min_rise "
                        f"{self.cfg.spike_min_rise:g})")
            self.log(verdict.spike, loss_spike=verdict.spike_ratio)
        if verdict.first_bad is not None:
            problem = f"step {verdict.first_bad}: the loss or gradient norm is not finite"
            if step > verdict.first_bad:
                problem += f" (in {verdict.bad_steps} of steps {verdict.first_bad}-{step})"
            self.log(step, nonfinite_steps=verdict.bad_steps)
            policy, setting = self.cfg.on_nonfinite, "on_nonfinite"
            if policy == "skip":
                if verdict.longest_streak < self.cfg.max_skipped_steps:
                    self.print0(f"WARNING: {problem}: their updates were skipped (train.on_nonfinite=skip)")
                    return None
                problem += (f", {verdict.longest_streak} in a row: train.max_skipped_steps="
                            f"{self.cfg.max_skipped_steps}")
                policy = "stop"
        elif verdict.spike is not None and self.cfg.on_spike != "warn":
            problem, policy, setting = f"step {verdict.spike}: a loss spike", self.cfg.on_spike, "on_spike"
            verdict.first_bad = verdict.spike
        else:
            return None
        if policy == "rewind":
            return self.rewind(problem, verdict.first_bad, step, batches_skipped, setting)
        raise Diverged(f"{problem}; {self.resume_advice(verdict.first_bad, setting)}")

    def finite_tags(self, before: int) -> list[str]:
        """The run's complete checkpoints saved before step `before`, oldest first: finite ones, since a save
        reads the watch first. Collective: a save still being written is completed first, and counts."""
        checkpoint.settle(self.engine)
        return [t for t in checkpoint.complete_tags(self.root)
                if not t.endswith("_universal") and checkpoint.tag_step(t) < before]

    def resume_advice(self, first_bad: int, setting: str) -> str:
        """Where to go on from, and how, after a stop that `setting` (on_nonfinite, on_spike) chose."""
        tags = self.finite_tags(first_bad)
        rewind = "" if getattr(self.cfg, setting) == "rewind" else f", or with train.{setting}=rewind"
        if not tags:
            return (f"no checkpoint was saved before it; fix: start again with a lower optim.lr{rewind} and a "
                    f"train.save_interval that saves before step {first_bad}")
        return (f"the newest finite checkpoint is {tags[-1]} (train.resume=auto resumes it); fix: resume with a "
                f"lower optim.lr{rewind}")

    def rewind(self, problem: str, first_bad: int, step: int, batches_skipped: int,
               setting: str) -> tuple[int, int]:
        """Collective: reload the newest checkpoint before `first_bad`; the batches of the steps after it, up to
        `step`, are left out, so the steps from it on train on the batches that follow."""
        tags = self.finite_tags(first_bad)
        if not tags:
            raise Diverged(f"{problem}, and there is no checkpoint to rewind to; "
                           f"{self.resume_advice(first_bad, setting)}")
        if self.rewinds == self.cfg.max_rewinds:
            raise Diverged(f"{problem}, after {self.rewinds} rewinds (train.max_rewinds); "
                           f"{self.resume_advice(first_bad, setting)}")
        self.rewinds += 1
        back = checkpoint.load(self.engine, os.path.join(self.root, tags[-1]))["step"]
        self.watch.streak.zero_()
        batches_skipped += step - back
        self.print0(f"WARNING: {problem}: rewound to {tags[-1]} (rewind {self.rewinds} of train.max_rewinds "
                 f"{self.cfg.max_rewinds}); the batches of steps {back + 1}-{step} are left out: step {back + 1} "
                 f"trains on the batch step {step + 1} would have, {batches_skipped} batches skipped in all")
        self.log(step, rewound_to=back, batches_skipped=batches_skipped)
        return back, batches_skipped
