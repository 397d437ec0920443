"""A mixture-of-experts run (model/moe.py) between its settings and DeepSpeed: the expert-parallel degree of the
ds_config and what it combines with, checked at start; DeepSpeed's expert groups; the router losses' weights;
and the routing figures the log shows. (DeepSpeed's engine puts the experts in optimizer groups of their own,
from training/optim.py's named groups.)"""
import contextlib

import torch

from common.checks import ConfigError
from model.config import ModelConfig
from model.moe import BiasedGate, ExpertParallel, MoEFeedForward, moe_layers

# The ds_config's expert-parallel degree. Ours: DeepSpeed's "expert_parallel" section configures AutoEP, which
# replaces a Hugging Face model's MoE blocks; here the model's own blocks hold DeepSpeed's MoE layer.
EP_KEY = "expert_parallel_size"


def expert_parallel_size(ds: dict) -> int:
    return ds.get(EP_KEY, 1)  # a positive integer (training/ds_config.py DS_NUMBERS)


def check_experts(cfg: ModelConfig, layout, zero_stage: int, fp16: bool, compile_blocks: bool,
                  mlp_tiles: int) -> None:
    """What a run with experts (or an expert-parallel degree) must satisfy, before any process group."""
    ep = layout.ep_size
    if not cfg.n_experts:
        if ep > 1:
            raise ConfigError(f"{EP_KEY}={ep} but the model has no experts (model.n_experts=0): set model.n_experts "
                              f"to a multiple of {ep}, or remove {EP_KEY} from the ds_config")
        return
    if cfg.n_experts % ep:
        raise ConfigError(f"{EP_KEY}={ep} does not divide model.n_experts={cfg.n_experts}: each expert-parallel rank "
                          f"holds an equal share of the experts; choose a divisor of {cfg.n_experts}")
    stage_ranks = layout.data_axis * layout.tp_size
    if stage_ranks % ep:
        raise ConfigError(f"{EP_KEY}={ep} does not divide the {stage_ranks} ranks of a pipeline stage: an expert group "
                          f"is {ep} consecutive ranks of one; launch a multiple of {ep} processes per stage")
    refusals = [
        (zero_stage == 3, "ZeRO stage 3: DeepSpeed's native MoE is not supported with ZeRO Stage 3 (its engine "
                          "refuses it); use ZeRO 0, 1 or 2 (ds_configs/zero2.json)"),
        (layout.pipeline_stages > 1 and cfg.moe_every > 1,
         f"pipeline stages at model.moe_every={cfg.moe_every}: a stage without an expert block would skip the expert "
         f"collectives DeepSpeed's pipeline engine runs on every stage (the job hangs); set model.moe_every=1"),
        (layout.tp_size > 1 and layout.pipeline_stages > 1,
         "tensor parallelism and pipeline stages together: DeepSpeed's MoE layer finds the tensor group through the "
         "engine's mpu, which a pipeline engine does not set; drop one"),
        (layout.tp_size > 1 and ep not in (1, layout.tp_size),
         f"tensor parallelism at {EP_KEY}={ep}: DeepSpeed's experts go over the tensor group; set it to 1 or "
         f"{layout.tp_size}"),
        (layout.sp_size > 1, "sequence parallelism: not yet in this repo (each rank would balance its slice of the "
                             "sequence); remove sequence_parallel_size"),
        (fp16, "fp16: the load-balancing loss's gradient does not follow the dynamic loss scale; use bf16 or fp32"),
        (compile_blocks, "train.compile: DeepSpeed's MoE layer routes with data-dependent shapes; set "
                         "train.compile=false"),
        (mlp_tiles > 1, "train.mlp_tiles: the experts' inputs are DeepSpeed's dispatched buffers, not a sequence to "
                        "tile; set train.mlp_tiles=1"),
    ]
    for refused, reason in refusals:
        if refused:
            raise ConfigError(f"model.n_experts={cfg.n_experts} cannot be combined with {reason}")


def expert_groups(ep_size: int, stages: int) -> ExpertParallel:
    """DeepSpeed's expert-parallel and expert-data-parallel groups of this degree within each of the `stages`
    pipeline stages, made now (the engine finds and uses them: its MoE layers look groups up by name before
    creating any), and this rank's place in its expert group. Collective."""
    from deepspeed.moe import mappings
    from deepspeed.utils import groups

    mappings._gather_tokens = _gather_tokens  # see there: DeepSpeed's fails on gloo
    name = f"ep_size_{ep_size}"  # DeepSpeed's MoE layer's name for its group
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size, pp_size=stages)
    return ExpertParallel(ep_size, groups._get_expert_parallel_rank(name))


def _gather_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """DeepSpeed's deepspeed.moe.mappings._gather_tokens, with an output buffer that gloo accepts: DeepSpeed gathers
    into a flat one, which NCCL takes and gloo refuses ("invalid tensor size"), so its MoE layer fails under tensor
    parallelism on CPUs. The same gather otherwise: each tensor rank's slice, concatenated along `dim`."""
    from deepspeed.utils import groups
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_world_size

    input_ = input_.contiguous()
    world = bwc_tensor_model_parallel_world_size(groups.mpu)
    if world == 1:
        return input_
    buffer = torch.empty((world * input_.size(0), *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    torch.distributed.all_gather_into_tensor(buffer, input_, group=bwc_tensor_model_parallel_group(groups.mpu))
    return buffer if dim == 0 else torch.cat(buffer.chunk(world, dim=0), dim=dim).contiguous()


def weigh_router_losses(model: torch.nn.Module, cfg: ModelConfig, grad_accum: int) -> None:
    """Each MoE layer's load-balancing loss and z-loss enter the gradients with weights router_aux_loss_coef and
    router_z_loss_coef, divided by the accumulation steps as DeepSpeed divides each micro-batch's loss."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = cfg.router_aux_loss_coef / grad_accum
        layer.z_loss_scale = cfg.router_z_loss_coef / grad_accum


@torch.no_grad()
def update_router_biases(model: torch.nn.Module, cfg: ModelConfig, group) -> None:
    """After a training step (collective over the data-parallel `group`): each biased router's per-expert bias
    moves by router_bias_rate toward even load, up for the experts that took fewer routes than the mean, down for
    those that took more (DeepSeek-V3's rule), from the step's routes on every data-parallel rank."""
    for layer in moe_layers(model):
        gate = layer.moe.deepspeed_moe.gate
        if isinstance(gate, BiasedGate):
            load = layer.load.to(gate.choice_bias.device, torch.float32)
            torch.distributed.all_reduce(load, group=group)
            gate.choice_bias += cfg.router_bias_rate * torch.sign(load.mean() - load)
            layer.load = torch.zeros_like(layer.load)


@contextlib.contextmanager
def recording_evaluation(model: torch.nn.Module):
    """Within it, the MoE layers record the routing of their evaluation forwards (never otherwise: sampling and
    serving would pile it up), for routing_figures(evaluation=True)."""
    layers = moe_layers(model)
    for layer in layers:
        layer.recording = True
    try:
        yield
    finally:
        for layer in layers:
            layer.recording = False


def routing_figures(model: torch.nn.Module, cfg: ModelConfig, n_layers: int, evaluation: bool = False) -> dict:
    """Collective over all ranks (a pipeline stage without an MoE layer takes part with zeros): the routing of
    every MoE layer's training forwards since the last call (then forgotten), whichever stage holds it: the mean
    load-balancing loss, the tokens each expert took (all ranks' tokens) as max / mean load, the worst layer's and
    the mean over layers, and under a capacity factor the share of routes dropped, with a z-loss its mean, with
    biased routers the largest bias. Empty for a dense model.
    n_layers: the model's layer list's length (a layer is named by its index in it, in both builds)."""
    if not cfg.n_experts:
        return {}
    source = "evaluated" if evaluation else "routed"  # an evaluation's forwards, or the training steps'
    device = next(model.parameters()).device
    counts = torch.zeros(n_layers, cfg.n_experts, device=device)
    # the load-balancing losses' sum, how many, the routes dropped, the z-losses' sum
    aux = torch.zeros(4, dtype=torch.float64, device=device)
    bias = torch.zeros((), device=device)
    for name, layer in model.named_modules():
        if not isinstance(layer, MoEFeedForward):
            continue
        if getattr(layer, source):
            losses, routes, dropped, z_losses = zip(*getattr(layer, source))
            aux += torch.stack([torch.stack(losses).double().sum(), torch.tensor(len(losses), device=device),
                                torch.stack(dropped).double().sum(), torch.stack(z_losses).double().sum()])
            counts[int(name.split(".")[0])] += torch.stack(routes).float().sum(dim=0)
        setattr(layer, source, [])
        if isinstance(layer.moe.deepspeed_moe.gate, BiasedGate):
            bias = torch.maximum(bias, layer.moe.deepspeed_moe.gate.choice_bias.abs().max())
    torch.distributed.all_reduce(aux)
    torch.distributed.all_reduce(counts)
    torch.distributed.all_reduce(bias, op=torch.distributed.ReduceOp.MAX)
    if not aux[1]:
        return {}
    dropped = (aux[2] / counts.sum()).item()
    counts = counts[counts.sum(dim=1) > 0]  # the MoE layers
    load = counts.max(dim=1).values / counts.mean(dim=1)
    return {"moe_aux_loss": (aux[0] / aux[1]).item(), "expert_load_max": load.max().item(),
            "expert_load_mean": load.mean().item(),
            **({"dropped_routes": dropped} if cfg.capacity_factor is not None else {}),
            **({"router_z_loss": (aux[3] / aux[1]).item()} if cfg.router_z_loss_coef else {}),
            **({"router_bias_max": bias.item()} if cfg.router_bias_rate else {})}
