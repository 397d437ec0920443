"""Rollouts for online RL: each prompt's group of answers sampled through the run's own engine and key/value cache
(training/engines.py decoder), the prompt prefilled once and its cache forked into the group's slots, every slot
stepped in one forward pass a token (model/generate.py). Each rank samples its own prompts.

Where a forward pass is collective over the data-parallel ranks (ZeRO-3 gathers each layer's weights; a mixture of
experts exchanges tokens between them), every rank must run as many as the others: ranks then step together until
the last answer of any of them ends, a rank whose answers have all ended stepping one of them again for nothing.
"""
from dataclasses import dataclass, field

import torch

from model.generate import Sampling, WindowDecoder, choose


@dataclass
class Rollout:
    prompt: list[int]
    answer: list[int] = field(default_factory=list)  # the drawn tokens, a stop id (kept) the last
    logps: list[float] = field(default_factory=list)  # the sampler's log-probability of each, at its temperature
    truncated: bool = False  # cut at max_new_tokens before any stop id


@torch.no_grad()
def roll_out(decoder: WindowDecoder, prompts: list[list[int]], group_size: int, sampling: Sampling,
             generators: list[torch.Generator], lockstep=False) -> list[Rollout]:
    """`group_size` answers of each prompt, the groups in the prompts' order, each group drawing from its prompt's
    generator (so a group's draws do not depend on which rank samples it, nor beside which others). `lockstep`:
    the data-parallel group (None for every rank) whose ranks must run as many forward passes, or False."""
    rollouts, slots, logits, drawing = [], [], {}, []
    try:
        for prompt, generator in zip(prompts, generators):
            slot, first = decoder.start(prompt)
            group = [slot] + [decoder.fork(slot) for _ in range(group_size - 1)]
            for s in group:
                logits[s] = first
                slots.append(s)
                drawing.append(generator)
                rollouts.append(Rollout(list(prompt)))
        for t in range(sampling.max_new_tokens):
            new = _draw(rollouts, slots, logits, sampling, drawing, last=t == sampling.max_new_tokens - 1)
            if lockstep is not False:
                going = torch.tensor(int(bool(new)), device=decoder.device)
                torch.distributed.all_reduce(going, op=torch.distributed.ReduceOp.MAX, group=lockstep)
                if not going.item():
                    break
                if not new:  # the others still draw: one forward pass alongside theirs, its logits unread
                    new = {slots[0]: rollouts[0].answer[-1:]}
            elif not new:
                break
            logits = decoder.step(new)
    finally:
        for slot in slots:
            decoder.release(slot)
    return rollouts


def _draw(rollouts: list[Rollout], slots: list[int], logits: dict, sampling: Sampling, generators: list,
          last: bool) -> dict[int, list[int]]:
    """Each unfinished answer's next token drawn from its slot's logits; returns {slot: [token]} of those that go
    on."""
    new = {}
    for rollout, slot, generator in zip(rollouts, slots, generators):
        if rollout.answer and (rollout.answer[-1] in sampling.stop_ids or rollout.truncated):
            continue
        row = logits[slot]
        token = choose(row, sampling, generator)
        rollout.answer.append(token)
        if sampling.temperature:
            rollout.logps.append(float(torch.log_softmax(row.float() / sampling.temperature, -1)[token]))
        if token in sampling.stop_ids:
            continue
        if last:
            rollout.truncated = True
            continue
        new[slot] = [token]
    return new
