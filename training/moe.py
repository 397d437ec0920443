"""A mixture-of-experts run (model/moe.py) between its settings and DeepSpeed: the expert-parallel degree of the
ds_config and what it combines with, checked at start; DeepSpeed's expert groups and the router losses' weights,
which training/parallelize.py applies as it builds the model. (DeepSpeed's engine puts the experts in optimizer
groups of their own, from training/optim.py's named groups; what the loop does for experts at each step is the
architecture's hooks, model/moe_hooks.py.)"""
import torch

from common.checks import ConfigError
from model.config import ModelConfig
from model.moe import ExpertParallel, balance_over, moe_layers
from model.sequence_parallel import SequenceParallel

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
        (zero_stage == 3, f"ZeRO stage 3: DeepSpeed's native MoE is not supported with ZeRO Stage 3 (its engine "
                          f"refuses it); the nearest layout is ZeRO-2 (ds_configs/zero2.json), which shards gradients "
                          f"and optimizer states, with {EP_KEY}={max(ep, 2)} to share out the experts' weights"),
        (layout.pipeline_stages > 1 and cfg.moe_every > 1,
         f"pipeline stages at model.moe_every={cfg.moe_every}: a stage without an expert block would skip the expert "
         f"collectives DeepSpeed's pipeline engine runs on every stage (the job hangs); set model.moe_every=1"),
        (layout.tp_size > 1 and layout.pipeline_stages > 1,
         "tensor parallelism and pipeline stages together: DeepSpeed's MoE layer finds the tensor group through the "
         "engine's mpu, which a pipeline engine does not set; drop one"),
        (layout.tp_size > 1 and ep not in (1, layout.tp_size),
         f"tensor parallelism at {EP_KEY}={ep}: DeepSpeed's experts go over the tensor group; set it to 1 or "
         f"{layout.tp_size}"),
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


def weigh_router_losses(model: torch.nn.Module, cfg: ModelConfig, grad_accum: int, sp: SequenceParallel) -> None:
    """Each MoE layer's load-balancing loss and z-loss enter the gradients with weights router_aux_loss_coef and
    router_z_loss_coef, divided by the accumulation steps as DeepSpeed divides each micro-batch's loss. Under
    sequence parallelism the load-balancing loss is the whole sequence's: its statistics are taken over the
    sequence ranks (the z-loss, a mean over tokens, is averaged over them with the gradients)."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = cfg.router_aux_loss_coef / grad_accum
        layer.z_loss_scale = cfg.router_z_loss_coef / grad_accum
    if sp.size > 1:
        balance_over(model, sp.group)
