"""Known, harmless messages of DeepSpeed and torch that every run printed, silenced one by one where they arise,
so that a warning in a run's output is one worth reading. Each names its source; no category is silenced, and
what a silenced line said is in the run's own start-up lines (train.py) where it matters."""
import functools
import importlib
import logging
import re
import warnings

import torch

from common import DropMessage

# DeepSpeed's ZeRO-1/2 gathers partitions with torch.distributed.all_gather_into_tensor and ZeRO-3 reduces its
# gradients with reduce_scatter_tensor, which torch deprecates by name only: every rank printed the first at its
# first step, the second at every step.
DEPRECATED_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor")


def ignore_deprecated_collectives() -> None:
    for name in DEPRECATED_COLLECTIVES:
        warnings.filterwarnings("ignore", message=rf"`torch.distributed.{name}` is deprecated", category=FutureWarning)


def silence_known_noise() -> None:
    # DeepSpeed's WarmupCosineLR.get_lr (runtime/lr_schedules.py) warns when asked before its first step: the
    # engine asks while it is built, and training/optim.py start_schedule steps it right after.
    logging.getLogger("DeepSpeed").addFilter(
        DropMessage("Attempting to get learning rate from scheduler before it has started"))
    # WarmupCosineLR.__init__ warns on every rank when the run is shorter than its warm-up; the run says it once,
    # in its own words, with what it means for the learning rate (training/optim.py schedule_note).
    logging.getLogger("DeepSpeed").addFilter(DropMessage(" is less than warmup_num_steps "))
    ignore_deprecated_collectives()
    # DeepSpeed's bf16 optimizer (runtime/bf16_optimizer.py, the GPU default's) prints memory usage in 15 lines
    # while it is built, with force=True: no setting turns it off. The memory a run uses is in its progress lines.
    from deepspeed.runtime import bf16_optimizer
    bf16_optimizer.see_memory_usage = lambda message, force=False: None
    # Lines DeepSpeed writes with print(), which no logging level reaches: each module's `print` drops only its
    # own known lines and passes everything else on.
    ds_comm = importlib.import_module("deepspeed.comm.torch")  # deepspeed.comm's attribute `torch` is torch
    ds_pipe_module = importlib.import_module("deepspeed.runtime.pipe.module")
    ds_pipe_topology = importlib.import_module("deepspeed.runtime.pipe.topology")
    # Every rank of every run on a CPU: "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"
    # (comm/torch.py build_shm_op), also when the op only loads from its cache. A failed build raises.
    _drop_prints(ds_comm, r"DeepSpeed \S+ built successfully$")
    # Rank 0 of a pipeline or tensor-parallel run: "Using topology: {ProcessCoord(pipe=0, data=0, model=0): 0,
    # ...}" from each PipelineParallelGrid (training/topology.py's and the PipelineModule's own); train.py's
    # topology line and, with tensor or sequence ranks, each rank's coordinates say it in words.
    _drop_prints(ds_pipe_topology, r"Using topology: ")
    # PipelineModule's seed settings and partition (runtime/pipe/module.py), "stage=0 layers=4", each layer's
    # index and class and the loss function: train.py's "stage 0: layers 0-3 (...) on ranks [0]" lines say it.
    _drop_prints(ds_pipe_module, r"SEED_LAYERS=\S+ BASE_SEED=", r"stage=\d+ layers=\d+$", r"    +\d+: ", r"  loss: ")
    # Every pipeline rank, at its first backward: torch's "c10d::broadcast_: an autograd kernel was not
    # registered to the Autograd key(s) but we are trying to backprop through it. This may lead to silently
    # incorrect behavior." Its cause is PipelineModule._synchronize_tied_weights, which copies the first stage's
    # tied embedding onto the last stage's LM head with an in-place broadcast (at build and after a checkpoint
    # load) while autograd records: torch then hooks the weight, and the hook warns when a gradient reaches it.
    # The hook passes the gradient on unchanged (it only warns), and the broadcast is a copy of values before
    # any forward, no step of the graph a gradient should flow back through: no gradient is wrong. Run without
    # autograd, the copy is the same and no hook is made; any other broadcast_ under autograd still warns.
    # The tied embedding's gradients equal one process's: tests/test_pipeline.py
    # ::test_pipeline_losses_and_grad_norms_equal_plain_ones (losses and gradient norms of pp 2, pp 3 and
    # pp 2 x dp 2 against pp 1, to 1e-5), and tests/test_noise.py.
    from deepspeed.runtime.pipe.module import PipelineModule
    if hasattr(PipelineModule, "_synchronize_tied_weights"):
        PipelineModule._synchronize_tied_weights = _without_autograd(PipelineModule._synchronize_tied_weights)


def _drop_prints(module, *patterns: str) -> None:
    """`print` in `module` (its globals come before the builtins), less the lines that match one of `patterns`."""
    known = [re.compile(p) for p in patterns]

    def print_unless_known(*args, sep=" ", **kwargs):
        if not any(p.match(sep.join(map(str, args))) for p in known):
            print(*args, sep=sep, **kwargs)
    module.print = print_unless_known  # set again by each call: the patterns of the latest, never stacked


def _without_autograd(method):
    if getattr(method, "without_autograd", False):  # silence_known_noise ran before in this process
        return method

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with torch.no_grad():
            return method(*args, **kwargs)
    wrapped.without_autograd = True
    return wrapped
