"""The reference's log-probabilities of every preference pair, computed once and kept beside the dataset.

DPO and IPO compare the policy with the model it started from. Instead of a second engine living beside the
trained one (which would not compose with pipelines, tensor and sequence parallelism or ZeRO-3), the run scores
every row of the dataset with its own engine before the first step, while its weights are still train.init_from's
(the reference), in whatever layout the run has: the rows' summed log-probabilities ride with their batches to
the loss from then on. They are written to <data.dir>/references/<fingerprint>.npz, the fingerprint a hash of
train.init_from's files: a later run from the same model reads them instead of scoring again, and a resumed run
reads the ones it started with (its checkpoint names the fingerprint) or stops at start if they are gone.
"""
import hashlib
import io
import math
import os

import numpy as np
import torch

from common.checks import ConfigError
from data.writer import write_atomic

FOLDER = "references"
SPLITS = ("train", "val")


def fingerprint(init_from: str) -> str:
    """A hash of the Hugging Face folder's config and weights: the reference's identity."""
    digest = hashlib.sha256()
    names = ["config.json"] + sorted(n for n in os.listdir(init_from) if n.endswith(".safetensors"))
    for name in names:
        digest.update(name.encode())
        with open(os.path.join(init_from, name), "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def reference_path(data_dir: str, ref_id: str) -> str:
    return os.path.join(data_dir, FOLDER, f"{ref_id}.npz")


def check_reference(data, ref_id: str, resuming: bool) -> None:
    """At start: a resumed run's reference is still there and of this dataset; a fresh run that must score one can
    write it."""
    path = reference_path(data.datasets[0].dir, ref_id)
    if os.path.exists(path):
        read_reference(path, data)
        return
    if resuming:
        raise ConfigError(f"the reference log-probabilities this run started with, {path}, are gone; fix: restore "
                          f"the file, or start a fresh run (train.resume=none, a new train.out_dir) from "
                          f"train.init_from, which scores them again")
    folder = os.path.dirname(path)
    existing = folder if os.path.isdir(folder) else data.datasets[0].dir
    if not os.access(existing, os.W_OK):
        raise ConfigError(f"the reference's log-probabilities are written to {folder}, which cannot be written; "
                          f"fix: make {existing} writable, or prepare the pairs into a folder that is")


def read_reference(path: str, data) -> dict:
    """{split: each row's log-probability} of a reference file, checked against the dataset's rows."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            values = {split: saved[split] for split in SPLITS}
            dataset = str(saved["dataset"])
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{path} is not a reference file of this version ({type(e).__name__}: {e}); fix: delete "
                          f"it, and the run scores the reference again") from None
    if dataset != data.datasets[0].id or any(len(values[s]) != 2 * data.pairs[s] for s in SPLITS):
        raise ConfigError(f"{path} holds the reference's log-probabilities of another preparation of "
                          f"{data.datasets[0].dir}; fix: delete it, and the run scores the reference again")
    return values


@torch.no_grad()
def score_rows(driver, data, split: str, rows: int, dp_rank: int, layout, device, vocab_size: int, sp
               ) -> torch.Tensor:
    """Collective: each of the first `rows` rows' summed loss over its answer (float64, on every rank), each
    data-parallel rank scoring its share in micro-batches of the training shape."""
    batches = [sp.split(*batch) for batch in data.scoring_batches(split, rows, dp_rank, layout, device)]
    return gathered_rows(driver, driver.choice_losses(batches, vocab_size), rows, dp_rank, layout, sp)


def gathered_rows(driver, values: torch.Tensor, rows: int, dp_rank: int, layout, sp) -> torch.Tensor:
    """Collective: the values of all `rows` rows (float64, on every rank) from each data-parallel rank's share of
    them, in data.scoring_batches' order (this rank's `values`, padded)."""
    per_rank = math.ceil(rows / layout.dp)
    first = dp_rank * per_rank
    mine = min(per_rank, max(rows - first, 0))
    everyone = torch.zeros(rows, dtype=torch.float64, device=values.device)
    # DeepSpeed's data-parallel group spans the sequence ranks too, which hold the same sums: the first gives them.
    if sp.rank == 0:
        everyone[first:first + mine] = values[:mine].double()
    torch.distributed.all_reduce(everyone, group=driver.data_parallel_group)
    return everyone


def load_or_score(run, rank, ref_id: str) -> str:
    """The reference's log-probabilities set in the run's data: read, or scored now (before the first step, the
    engine holding train.init_from's weights) and written. Returns what was done, for the start-up lines."""
    data = run.data
    path = reference_path(data.datasets[0].dir, ref_id)
    if os.path.exists(path):
        values = read_reference(path, data)
        done = f"reference log-probabilities read from {path}"
    else:
        vocab = run.cfg.model.vocab_size
        values = {split: -score_rows(rank.driver, data, split, 2 * data.pairs[split], rank.dp_rank, run.layout,
                                     run.device, vocab, rank.sp).cpu().numpy() for split in SPLITS}
        if rank.index == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_atomic(path, _npz_bytes(values, data.datasets[0].id))
        torch.distributed.barrier()
        done = f"reference log-probabilities of {sum(data.pairs.values()):,} pairs scored and written to {path}"
    for split in SPLITS:
        data.set_reference(split, values[split])
    return done


def _npz_bytes(values: dict, dataset: str) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, dataset=np.array(dataset), **values)
    return buffer.getvalue()
