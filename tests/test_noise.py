"""training/noise.py: the known DeepSpeed and torch messages are gone from a pipeline run's output, each silenced
where it arises (DeepSpeed's own code run in this process, a world of one over gloo), and nothing else with
them; the tied weights' copy that made torch warn of "silently incorrect behavior" leaves every gradient as it
was."""
import importlib
import logging
import os
import warnings
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology
from omegaconf import OmegaConf

from harness import FP32, TINY, free_port, launch
from training.config import RunConfig
from training.launch.failure import join_process_group, leave_process_group
from training.noise import ignore_deprecated_collectives, silence_known_noise
from training.optim import optimizer_and_schedule, schedule_note

# What each silenced message began with; a run prints none of them.
KNOWN_NOISE = ["c10d::broadcast_: an autograd kernel was not registered", "Using topology: ", "SEED_LAYERS=",
               "stage=0 layers=", "deepspeed_shm_comm_op built successfully", "is less than warmup_num_steps"]
C10D = "c10d::broadcast_: an autograd kernel was not registered"


@pytest.fixture(scope="module")
def process_group():
    """A one-rank gloo world, with the launcher's variables set only while this module's tests use it."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    with mock.patch.dict(os.environ, env):
        join_process_group()
        silence_known_noise()
        yield
        leave_process_group()


def tied(layer: torch.nn.Module) -> SimpleNamespace:
    """What PipelineModule._synchronize_tied_weights reads of its module: one tie, its weight held by `layer`."""
    return SimpleNamespace(tied_comms={"embed": {"weight_attr": ["weight"], "module": layer, "ranks": [0],
                                                 "group": None}},
                           _recursive_getattr=PipelineModule._recursive_getattr)


def layer_() -> torch.nn.Linear:
    made = torch.nn.Linear(3, 4)
    with torch.no_grad():
        made.weight.copy_(torch.arange(12.0).reshape(4, 3) / 10)
        made.bias.zero_()
    return made


def gradient_and_warnings(synchronize) -> tuple[torch.Tensor, list[str]]:
    """The weight gradient of a layer whose weight `synchronize` broadcast in place before its forward, as
    PipelineModule does at build, and the warnings its backward raised."""
    layer = layer_()
    synchronize(tied(layer))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (layer(torch.tensor([[1.0, -2.0, 0.5]])) ** 2).sum().backward()
    return layer.weight.grad, [str(w.message) for w in caught]


def test_the_tied_weights_copy_leaves_the_gradient_as_it_was_and_no_warning(process_group):
    """DeepSpeed's copy, run as it runs unpatched (autograd recording), makes torch hook the weight: the hook
    warns at the backward and passes the gradient on unchanged. Run without autograd (noise.py) it warns not."""
    reference = layer_()
    (reference(torch.tensor([[1.0, -2.0, 0.5]])) ** 2).sum().backward()
    unpatched = PipelineModule._synchronize_tied_weights.__wrapped__
    assert unpatched is not PipelineModule._synchronize_tied_weights  # noise.py wrapped DeepSpeed's method
    grad, messages = gradient_and_warnings(unpatched)
    assert any(C10D in m for m in messages)  # the warning a pipeline rank printed, reproduced
    assert torch.equal(grad, reference.weight.grad)  # ... over a gradient that is right
    grad, messages = gradient_and_warnings(PipelineModule._synchronize_tied_weights)
    assert not any(C10D in m for m in messages)
    assert torch.equal(grad, reference.weight.grad)


def test_any_other_broadcast_under_autograd_still_warns(process_group):
    """Only the tied weights' copy runs without autograd: torch's warning stays on for every other one."""
    weight = torch.nn.Parameter(torch.ones(2, 2))
    torch.distributed.broadcast(weight, src=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        weight.sum().backward()
    assert any(C10D in str(w.message) for w in caught)


def test_deepspeeds_printed_lines_are_dropped_and_no_others(process_group, capsys):
    """DeepSpeed's own code prints its grid's topology and a PipelineModule's seeds and partition: dropped.
    The same modules' other lines, and every other module's, still print."""
    PipelineParallelGrid(topology=PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=1))
    PipelineModule(layers=[LayerSpec(torch.nn.Linear, 2, 2), LayerSpec(torch.nn.Linear, 2, 2)], num_stages=1,
                   loss_fn=torch.nn.functional.mse_loss)
    importlib.import_module("deepspeed.comm.torch").print("DeepSpeed deepspeed.ops.comm.x_op built successfully")
    assert capsys.readouterr().out == ""
    for name in ("deepspeed.comm.torch", "deepspeed.runtime.pipe.module", "deepspeed.runtime.pipe.topology"):
        importlib.import_module(name).print("RANK=0 tied_comms={}", "and more", sep=": ")
    print("stage=0 layers=4")  # this module's print is the builtin
    assert capsys.readouterr().out == "RANK=0 tied_comms={}: and more\n" * 3 + "stage=0 layers=4\n"


@pytest.mark.parametrize("collective", ["all_gather_into_tensor", "reduce_scatter_tensor"])
def test_the_collectives_zero_calls_by_their_deprecated_names_warn_of_nothing(process_group, collective):
    """ZeRO-1/2 gather and ZeRO-3 reduce-scatters through names torch deprecates: each warned, every time shown."""
    import torch.distributed as dist
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(dist, collective)(torch.zeros(4), torch.ones(4))
        assert [str(w.message) for w in caught if collective in str(w.message)] != []  # torch's warning, shown
        caught.clear()
        ignore_deprecated_collectives()
        getattr(dist, collective)(torch.zeros(4), torch.ones(4))
    assert [str(w.message) for w in caught if collective in str(w.message)] == []


def test_deepspeeds_short_schedule_warning_is_dropped(process_group):
    """The run says it once in its own words (training/optim.py schedule_note); DeepSpeed's other warnings pass."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(handler)
    try:
        WarmupCosineLR(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0), total_num_steps=6,
                       warmup_num_steps=100, warmup_type="linear")
        logger.warning("another warning")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["another warning"]


@pytest.mark.parametrize("max_steps,warmup", [(20, 100), (99, 100), (1, 2), (100, 100), (101, 100), (5, 1)])
def test_a_run_within_its_warmup_is_said_once_with_the_learning_rate_deepspeed_gives(max_steps, warmup):
    """schedule_note's rate and its "never decays" against DeepSpeed's scheduler as the run builds it."""
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "train": {"max_steps": max_steps}, "optim": {"warmup_steps": warmup, "lr": 1e-3, "min_lr": 1e-4}}))
    params = optimizer_and_schedule(cfg, {})["scheduler"]["params"]
    scheduler = WarmupCosineLR(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1e-3), **params)
    rates = [scheduler.step(step) or scheduler.get_lr()[0] for step in range(1, max_steps + 1)]  # step k: iteration k
    note = schedule_note(cfg)
    if max_steps >= warmup:
        assert note is None and rates[-1] == pytest.approx(1e-4)  # the schedule ends at min_lr
        return
    assert rates == sorted(rates) and rates[-1] < 1e-3  # only rises, never reaches optim.lr
    assert note == (f"schedule: train.max_steps={max_steps} ends within optim.warmup_steps={warmup}: the learning "
                    f"rate warms up to {rates[-1]:.2e} at step {max_steps} (optim.lr=0.001 x {max_steps}/{warmup}) "
                    f"and never decays; set optim.warmup_steps below train.max_steps for the whole warmup-cosine "
                    f"schedule")


@pytest.mark.launch
def test_a_pipeline_run_prints_none_of_the_known_noise(tmp_path, char_data):
    """pp 2 over two ranks, shorter than its warm-up: every message above arose in it before noise.py."""
    proc = launch(2, "pipe2.json", tmp_path, char_data, [*TINY, *FP32, "train.max_steps=2"])
    output = proc.stdout + proc.stderr
    assert "step 2 | loss" in output
    assert [noise for noise in KNOWN_NOISE if noise in output] == []
