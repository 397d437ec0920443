"""Which steps save a checkpoint, and the room the run's checkpoints need, checked at start: a run that would fill
its disk stops with "No space left on device" at a save hours in (the last complete checkpoint survives it, the
hours do not); one whose background saves cannot copy a checkpoint into the host's memory dies at its first save."""
import json
import os
import shutil

import torch

from common.checks import ConfigError
from training.checkpoints import checkpoint
from training.device import memory_capacity
from training.topology import sixteen_bit_type, zero_stage


def size(n_bytes: float) -> str:
    """Bytes as df -H and cloud disks count them: 19.6 MB, 75.7 GB, 5.77 TB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.3g} {unit}"
    return f"{n_bytes:.0f} bytes"


def saves_at(step: int, last_step: int, interval: int) -> bool:
    """Whether training step `step` ends with a checkpoint: every train.save_interval steps (0: none) and the last."""
    return bool(interval and step % interval == 0) or step == last_step


def saves_between(start: int, last_step: int, interval: int) -> int:
    """How many of steps start + 1 .. last_step save (saves_at), counted without walking them."""
    if last_step <= start:
        return 0
    periodic = last_step // interval - start // interval if interval else 0
    return periodic + (0 if interval and last_step % interval == 0 else 1)


def weight_bytes(ds: dict) -> int:
    """What the model files hold a parameter's weight in: the compute dtype, or nothing under ZeRO-3, which keeps
    the weights in its partitions."""
    return 0 if zero_stage(ds) == 3 else (2 if sixteen_bit_type(ds) else 4)


def bytes_per_parameter(ds: dict) -> int:
    """What a checkpoint of DeepSpeed's holds a parameter in, with AdamW: the weights (weight_bytes), the fp32
    master copy (none in fp32 without ZeRO, where the weights are the masters; ZeRO 1-2 keep one beside fp32
    weights too) and the two moments. Measured on the quickstart GPT: 12.09 (ZeRO-0 fp32), 14.11 (ZeRO-0 bf16),
    16.03 (ZeRO-1 fp32), 14.03 (ZeRO-1, ZeRO-2 and offload in bf16), 12.04 (ZeRO-3), the rest a few kB of each
    file's own. A pipeline's tied weights and tensor parallelism's replicated ones are written more than once:
    more."""
    master = 0 if zero_stage(ds) == 0 and not sixteen_bit_type(ds) else 4
    return weight_bytes(ds) + master + 8


def checkpoint_bytes(n_params: int, ds: dict, resume_dir: str | None) -> int:
    """One checkpoint of this run: the size of the one it resumes, else its parameters at bytes_per_parameter
    (at least that much)."""
    return saved_bytes(resume_dir) if resume_dir else n_params * bytes_per_parameter(ds)


def node_share(ds: dict, layout, ranks_here: int) -> float:
    """The part of a checkpoint that a node of `ranks_here` ranks writes, counted for a node of the first
    data-parallel replica, the busiest: that replica's ranks write the weights of their model-parallel slices (and
    without ZeRO the optimizer's states too); with ZeRO each rank writes its partition of the rest."""
    slices = min(1.0, ranks_here / (layout.tp_size * layout.pipeline_stages))
    if zero_stage(ds) == 0:
        return slices
    weights, whole = weight_bytes(ds), bytes_per_parameter(ds)
    return (weights * slices + (whole - weights) * ranks_here / layout.world_size) / whole


def saved_bytes(tag_dir: str) -> int:
    """A complete checkpoint's bytes, as its manifest lists them (read_run_state has held the files to it)."""
    with open(os.path.join(tag_dir, checkpoint.MANIFEST)) as f:
        return sum(json.load(f)["files"].values())


def check_disk(train, ds: dict, n_params: int, start: int, resume_dir: str | None) -> None:
    """Refuse a run whose checkpoints cannot fit its out_dir's disk: at the peak, the kept ones (train.keep_checkpoints
    of them, those already there counted as written) and the one being written before the oldest goes. A checkpoint
    is checkpoint_bytes."""
    saves = saves_between(start, train.last_step, train.save_interval)
    if not saves:
        return
    root = checkpoint.checkpoint_root(train.out_dir)
    there = len(checkpoint.complete_tags(root)) if os.path.isdir(root) else 0
    written_at_once = max(1, min(there + saves - 1, train.keep_checkpoints) + 1 - there)
    one = checkpoint_bytes(n_params, ds, resume_dir)
    existing = root
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing) or "."
    free = shutil.disk_usage(existing).free
    if written_at_once * one > free:
        each = f"{size(one)} each, " + ("as the one resumed" if resume_dir else
                                        f"{bytes_per_parameter(ds)} bytes a parameter")
        raise ConfigError(f"the checkpoints this run writes need {size(written_at_once * one)} more in {root} "
                          f"({written_at_once} at once: {each}), where the disk has {size(free)} free; fix: free "
                          f"space there, lower train.keep_checkpoints (now {train.keep_checkpoints}), or set "
                          f"train.out_dir on a larger disk")


def check_host_copy(train, ds: dict, layout, n_params: int, start: int, resume_dir: str | None, resident: float,
                    ranks_here: int) -> None:
    """Refuse a run whose background saves cannot copy this node's share of a checkpoint into host memory beside
    the `resident` bytes each of its `ranks_here` ranks keeps there (a CPU rank's states and activations, a GPU
    rank's offloaded states). The copy on a GPU is page-locked memory that torch's host allocator keeps from one
    save to the next."""
    if not train.background_save or not saves_between(start, train.last_step, train.save_interval):
        return
    copy = checkpoint_bytes(n_params, ds, resume_dir) * node_share(ds, layout, ranks_here)
    host, what = memory_capacity(torch.device("cpu"), 1)
    if copy + resident * ranks_here > host:
        kept = f" beside the {size(resident * ranks_here)} the run keeps there" if resident else ""
        raise ConfigError(f"a background save copies this node's share of each checkpoint, {size(copy)}, into host "
                          f"memory{kept}, over {what}, {size(host)}; fix: set train.background_save=false (each save "
                          f"then writes from the states in place while the loop waits), or spread the run over more "
                          f"nodes")
