"""Multiple-choice scoring, one rule for the training loop (eval.tasks) and for lm-evaluation-harness
(training/evaluation/lm_eval_model.py).

A choice is scored on one row: its context followed by its tokens, cut to the model's last block_size + 1
tokens (the context loses its start first, as in the harness), the targets only on the choice's tokens. Its
loss is the sum of those tokens' losses. `acc` picks the choice of least summed loss, `acc_norm` the least
loss per token (build-nanogpt's HellaSwag). The harness reports acc by the same rule, and normalises its
acc_norm by the choice's length in characters instead.

In the loop each data-parallel rank scores a contiguous share of every task's examples, in micro-batches of
the training's micro batch (a pipeline's of its training shape), and the right answers are counted over the
ranks: the same total whatever the layout.
"""
import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from common.checks import ConfigError
from data.tasks import Example, Task, read_task, task_file, task_name
from data.token_data import IGNORE
from model.tensor_parallel import SINGLE, TensorParallel, cross_entropy_rows
from training.steps import LOSS_CHUNK_ROWS


@dataclass
class Row:
    ids: list[int]  # at most block_size + 1 tokens
    scored: int  # the last `scored` of them are the choice's


PADDING = Row([0, 0], 0)  # fills a rank's last micro-batch: nothing scored


def choice_row(context: list[int], choice: list[int], block_size: int) -> Row:
    """The row that scores `choice` after `context`; ValueError for a choice longer than the model's context."""
    if len(choice) > block_size:
        raise ValueError(f"a choice of {len(choice)} tokens is longer than the model's context of {block_size}")
    return Row((context + choice)[-(block_size + 1):], len(choice))


def batches(rows: list[Row], size: int, length: int | None = None):
    """(inputs, targets) of `size` rows at a time, right-padded to the batch's longest row or to `length`; the
    targets are IGNORE but on each row's scored tokens."""
    for start in range(0, len(rows), size):
        part = rows[start:start + size]
        width = length or max(len(row.ids) - 1 for row in part)
        inputs = torch.zeros((len(part), width), dtype=torch.long)
        targets = torch.full((len(part), width), IGNORE, dtype=torch.long)
        for i, row in enumerate(part):
            n = len(row.ids) - 1
            inputs[i, :n] = torch.tensor(row.ids[:-1])
            if row.scored:
                targets[i, n - row.scored:n] = torch.tensor(row.ids[-row.scored:])
        yield inputs, targets


def row_losses(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, tp: TensorParallel = SINGLE,
               chunk_rows: int = LOSS_CHUNK_ROWS) -> torch.Tensor:
    """(batch,) fp32: the summed loss of each row's scored targets, over the `vocab_size` real tokens: the
    padding of the vocabulary (model.vocab_multiple) takes no probability, so a score depends on the real
    tokens' logits alone, whatever the padding or its weights (an export to Hugging Face drops them). A chunk of
    `chunk_rows` tokens at a time, as the training loss (training/steps.py lm_loss): the fp32 logits never exist for
    the whole batch, and with gradients (preference tuning) each chunk's are made again in the backward pass."""
    flat, flat_targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    start = tp.rank * flat.size(-1)  # this tensor rank's slice of the vocabulary
    padding = torch.arange(start, start + flat.size(-1), device=flat.device) >= vocab_size

    def token_losses(rows: torch.Tensor, row_targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_rows(rows.float().masked_fill(padding, float("-inf")), row_targets, tp)
    chunks = zip(flat.split(chunk_rows), flat_targets.split(chunk_rows))
    if torch.is_grad_enabled() and flat.size(0) > chunk_rows:
        per_token = [checkpoint(token_losses, rows, row_targets, use_reentrant=False) for rows, row_targets in chunks]
    else:
        per_token = [token_losses(rows, row_targets) for rows, row_targets in chunks]
    return torch.cat(per_token).view(targets.shape).sum(dim=-1)


def choose(losses: list[float], lengths: list[int]) -> tuple[int, int]:
    """(acc's choice, acc_norm's choice): the least summed loss, the least loss per token; the first of equals,
    as the harness's argmax of log-likelihoods takes."""
    choices = range(len(losses))
    return min(choices, key=lambda i: losses[i]), min(choices, key=lambda i: losses[i] / lengths[i])


def open_tasks(specs: list[str], data_dir: str, limit: int | None, tokenizer, block_size: int) -> list[Task]:
    """eval.tasks read, tokenized and checked to fit the model's context, at start."""
    tasks = []
    for spec in specs:
        path = task_file(spec, data_dir)
        task = read_task(path, tokenizer, limit, task_name(spec))
        longest = max(len(ending) for example in task.examples for ending in example.ending_ids)
        if longest > block_size:
            raise ConfigError(f"eval.tasks {spec}: an ending of {longest} tokens is longer than model.block_size="
                              f"{block_size}; fix: shorten the task's endings, or score it with a longer context")
        tasks.append(task)
    return tasks


class ChoiceScorer:
    """This rank's share of the tasks as rows, and the tasks' accuracies from the rows' losses."""

    def __init__(self, tasks: list[Task], block_size: int, dp_rank: int, dp: int, micro_batch: int,
                 fixed_shape: bool, sequence_ranks: int = 1):
        """fixed_shape: every micro-batch block_size wide (a pipeline engine keeps its first shape; sequence ranks
        split the whole window). sequence_ranks: the ranks of each replica that hold its rows' losses alike."""
        self.tasks, self.micro_batch, self.sequence_ranks = tasks, micro_batch, sequence_ranks
        self.length = block_size if fixed_shape else None
        self.mine = []  # (task index, example) of this rank
        rows_per_rank = [0] * dp
        for t, task in enumerate(tasks):
            share = math.ceil(len(task.examples) / dp)
            for rank in range(dp):
                part = task.examples[rank * share: (rank + 1) * share]
                rows_per_rank[rank] += sum(len(example.ending_ids) for example in part)
                if rank == dp_rank:
                    self.mine += [(t, example) for example in part]
        self.rows = [choice_row(example.context_ids, ending, block_size)
                     for _, example in self.mine for ending in example.ending_ids]
        # Every rank runs as many forwards: ZeRO-3 gathers each layer's weights from all of them.
        self.rows += [PADDING] * (math.ceil(max(rows_per_rank) / micro_batch) * micro_batch - len(self.rows))

    def describe(self) -> str:
        return ", ".join(f"{task.name} ({len(task.examples):,} examples)" for task in self.tasks)

    def batches(self, device: torch.device, with_positions: bool = False) -> list:
        """The rows in micro-batches on the device; with_positions: inputs as (ids, positions), one document a row."""
        out = []
        for inputs, targets in batches(self.rows, self.micro_batch, self.length):
            inputs = inputs.to(device)
            if with_positions:
                inputs = (inputs, torch.arange(inputs.size(1), device=device).expand_as(inputs).contiguous())
            out.append((inputs, targets.to(device)))
        return out

    def scores(self, losses: torch.Tensor, group) -> dict[str, tuple[float, float]]:
        """{task: (acc, acc_norm)} over every rank of `group` (the engine's data axis: data-parallel replicas x
        their sequence ranks) from this rank's row losses."""
        right = right_answers(self.mine, len(self.tasks), losses.tolist()).to(losses.device)
        torch.distributed.all_reduce(right, group=group)
        right /= self.sequence_ranks  # each replica's answers, counted by every one of its sequence ranks
        return {task.name: tuple(float(n) / len(task.examples) for n in right[t].tolist())
                for t, task in enumerate(self.tasks)}


def right_answers(examples: list[tuple[int, Example]], tasks: int, losses: list[float]) -> torch.Tensor:
    """(tasks, 2) float64: the examples (task index, example) that acc and acc_norm answer right, from the losses
    of their rows in order."""
    right = torch.zeros(tasks, 2, dtype=torch.float64)
    row = 0
    for t, example in examples:
        k = len(example.ending_ids)
        picks = choose(losses[row:row + k], [len(ending) for ending in example.ending_ids])
        right[t] += torch.tensor([pick == example.label for pick in picks], dtype=torch.float64)
        row += k
    return right
