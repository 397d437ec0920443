"""A layout planner: the layouts this repo can run a preset on for a number of GPUs (ZeRO stage, tensor,
sequence and pipeline degrees, micro-batch, recomputation of the blocks: none, selective or full, the optimizer
offloaded to the CPU), each one's memory per GPU (training/memory_plan.py) and an estimated step time and MFU, the
fastest that fits recommended. The command:
`python -m scripts.memory_plan --config PRESET.yaml --gpus 64 --gpu_gb 80 --plan` (scripts/memory_plan.py).

The step time is a stated model, its assumptions printed with every table and each settable:
- compute: the step's training FLOPs (training/metrics.py flops_per_token x tokens; a third more when every
  block's forward runs again for its backward; under selective recomputation with tensor parallelism, the
  row-parallel projections once more; the norms and activation functions it runs again move memory and are not
  counted) over the GPUs at `mfu` of `peak_tflops`;
- DeepSpeed's 1F1B pipeline: (stages - 1) idle micro-batch slots of a stage's work besides its accumulation steps;
- tensor parallelism: 4 ring all-reduces a layer and micro-batch of its activations (16-bit), 2 forward and 2
  backward (and the forward's 2 again in a recomputed block), over a node's links (`intra_gbps`, GB/s a GPU);
  with the sequence split between the tensor ranks (Megatron's sequence parallelism, chosen wherever the model
  allows it) all-gathers and reduce-scatters that move as much;
- sequence parallelism (Ulysses): 4 all-to-alls a layer and micro-batch (q, k, v, the output) of its slice;
- data parallelism, once a step over the data and sequence ranks: under ZeRO-1/2 an all-reduce of the fp32
  gradients (the shipped ds_configs' communication_data_type) and an all-gather of the updated 16-bit weights,
  under ZeRO-3 a reduce-scatter of the gradients and an all-gather of the weights for the forward and another for
  the backward; over the network between nodes (`inter_gbps`) when the group leaves a node; under LoRA
  (model.lora_rank) the gradients and updated weights are the adapters' alone;
- expert parallelism: 4 all-to-alls a mixture-of-experts layer and micro-batch (dispatch and combine, forward and
  backward) of each token's k routes, as if the routing were even, inside a node when the expert group is;
- the pipeline's activations passed between stages, over the network;
- the optimizer offloaded (ZeRO-2/3, DeepSpeed's CPU Adam): each step a rank's fp32 gradient partition to the host
  and its 16-bit weights back over PCIe (`pcie_gbps`), and CPU Adam over the partition at `cpu_adam_gparams`
  billion parameters a second for each GPU's share of the host's cores;
- nothing overlapped with compute: a bound from above on the step time.
A layout fits when its plan fits the GPU's memory and its offloaded states the host's (`host_gb` a node).
Not enumerated: ZeRO-0 (ZeRO-1 holds less for the same traffic).
"""
from dataclasses import dataclass

from common.checks import ConfigError
from model import architecture
from model.parallelize import check_sequence_split
from training.memory_plan import fits, layer_params, plan
from training.metrics import flops_per_token
from training.moe import check_experts
from training.topology import RECOMPUTE, resolve_layout

MICRO_BATCHES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Assumptions:
    gpu_gb: float = 79.1  # an "80 GB" H100's 79.1 GiB
    peak_tflops: float = 989.0  # H100 SXM, dense bf16
    mfu: float = 0.45  # of the peak, for the matmuls' share of a step
    intra_gbps: float = 450.0  # NVLink 4, one direction, a GPU
    inter_gbps: float = 50.0  # 400 Gb/s InfiniBand or RoCE, a GPU
    pcie_gbps: float = 25.0  # assumed: host-device copies a GPU, under PCIe 4 x16's 32 GB/s on paper
    cpu_adam_gparams: float = 1.0  # assumed, not measured here: DeepSpeed's CPU Adam on a GPU's share of the cores
    host_gb: float = 2048.0  # a DGX H100's host memory

    def describe(self) -> str:
        return (f"assumed: {self.gpu_gb:g} GB a GPU, {self.peak_tflops:g} TFLOP/s peak at {self.mfu:.0%} MFU in "
                f"compute, {self.intra_gbps:g} GB/s inside a node, {self.inter_gbps:g} GB/s between nodes, no "
                f"overlap of communication with compute; offloaded: {self.pcie_gbps:g} GB/s PCIe, CPU Adam "
                f"{self.cpu_adam_gparams:g}B parameters/s a GPU, {self.host_gb:g} GB of host memory a node")


@dataclass(frozen=True)
class Candidate:
    tp: int
    sp: int
    pp: int
    dp: int
    zero: int
    micro: int
    accum: int
    recompute: str  # "none", or what a checkpointed block runs again: "full", "selective"
    ep: int = 1
    offload: bool = False
    tp_sequence: bool = False

    def ds_config(self) -> dict:
        zero = {"stage": self.zero, **({"offload_optimizer": {"device": "cpu", "pin_memory": True}}
                                       if self.offload else {})}
        return {"train_micro_batch_size_per_gpu": self.micro, "gradient_accumulation_steps": self.accum,
                "zero_optimization": zero, "tensor_model_parallel_size": self.tp,
                **({"tensor_sequence_parallel": True} if self.tp_sequence else {}),
                "sequence_parallel_size": self.sp, "expert_parallel_size": self.ep, "bf16": {"enabled": True},
                "pipeline": {"stages": self.pp, "partition": "parameters",
                             "activation_checkpoint_interval": int(self.recompute != "none"),
                             **({"recompute": self.recompute} if self.recompute != "none" else {})}}

    def describe(self) -> str:
        degrees = "".join(f" x {name} {n}" for name, n in (("tp", self.tp), ("sp", self.sp), ("pp", self.pp),
                                                           ("ep", self.ep)) if n > 1)
        degrees = degrees.replace(f"tp {self.tp}", f"tp {self.tp} (sequence split)") if self.tp_sequence else degrees
        return (f"dp {self.dp}{degrees}, ZeRO-{self.zero}{' + CPU offload' if self.offload else ''}, micro "
                f"{self.micro} x {self.accum}{'' if self.recompute == 'none' else f', {self.recompute} recompute'}")


def candidates(cfg, gpus: int, gpus_per_node: int, global_batch: int):
    """Every layout of `global_batch` windows a step on `gpus` GPUs that train.py accepts: tensor and sequence groups
    inside a node, the sequence split between the tensor ranks where the model allows, degrees that divide the heads and
    the context, a block for every stage, an expert-parallel degree that divides the experts (plan_layouts leaves out
    what check_experts refuses), the optimizer offloaded under ZeRO-2/3 without pipeline stages (DeepSpeed's pipeline
    engine takes ZeRO-0/1 only)."""
    blocks = cfg.n_layer
    for tp in divisors(gpus_per_node):
        for sp in divisors(gpus_per_node // tp):
            if cfg.n_head % (tp * sp) or cfg.kv_heads % (tp * sp) or cfg.block_size % sp:
                continue
            split_sequence = tp > 1 and sequence_split_allowed(cfg, tp, sp)
            for pp in (p for p in divisors(gpus // (tp * sp)) if p <= blocks):
                dp = gpus // (tp * sp * pp)
                zeros = [(1, False)] if pp > 1 else [(1, False), (2, False), (3, False), (2, True), (3, True)]
                for zero, offload in zeros:
                    for micro in MICRO_BATCHES:
                        if global_batch % (micro * dp) or global_batch // (micro * dp) < pp:
                            continue
                        for recompute in ("none", *RECOMPUTE):
                            for ep in divisors(cfg.n_experts) if cfg.n_experts else (1,):
                                yield Candidate(tp, sp, pp, dp, zero, micro, global_batch // (micro * dp),
                                                recompute, ep, offload, split_sequence)


def sequence_split_allowed(cfg, tp: int, sp: int) -> bool:
    """Megatron's sequence parallelism holds less for the same traffic: chosen wherever train.py takes it."""
    try:
        check_sequence_split(cfg, tp, sp)
        return True
    except ConfigError:
        return False


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def step_seconds(cfg, c: Candidate, gpus_per_node: int, a: Assumptions) -> float:
    """The model's step time of candidate `c` (the module's docstring)."""
    tokens = c.micro * c.accum * c.dp * cfg.block_size
    compute = flops_per_token(cfg) * tokens * (4 / 3 if c.recompute == "full" else 1)
    if c.recompute == "selective" and c.tp > 1:  # the row-parallel projections, run again
        compute += 2 * cfg.n_embd * (cfg.q_width + architecture(cfg).mlp_hidden(cfg)) * cfg.n_layer * tokens
    per_gpu = compute / (c.dp * c.tp * c.sp * c.pp) / (a.peak_tflops * 1e12 * a.mfu)
    per_gpu *= (c.accum + c.pp - 1) / c.accum  # 1F1B's bubble
    layers = cfg.n_layer / c.pp
    slice_bytes = 2 * c.micro * cfg.block_size / c.sp * cfg.n_embd  # a micro-batch's activations on a rank, 16-bit
    comm = 0.0
    if c.tp > 1:  # a recomputed block runs its forward's two collectives again
        collectives = 4 if c.recompute == "none" else 6
        comm += c.accum * layers * collectives * 2 * (c.tp - 1) / c.tp * slice_bytes / (a.intra_gbps * 1e9)
    if c.sp > 1:
        inside = c.tp * c.sp <= gpus_per_node
        comm += c.accum * layers * 4 * (c.sp - 1) / c.sp * slice_bytes / (
            (a.intra_gbps if inside else a.inter_gbps) * 1e9)
    params = sum(layer_params(cfg)) / (c.tp * c.pp)  # a rank's share of the weights before ZeRO
    # What has gradients and optimizer states: the adapters alone under LoRA (model.lora_rank)
    trained = sum(layer_params(cfg, trainable=True)) / (c.tp * c.pp) if cfg.lora_rank else params
    data_bw = (a.intra_gbps if c.dp * c.tp * c.sp <= gpus_per_node else a.inter_gbps) * 1e9
    gather = (c.dp * c.sp - 1) / (c.dp * c.sp)  # of the bytes, what a ring's all-gather moves through a GPU
    if c.zero == 3:
        comm += gather * (4 * trained + 2 * 2 * params) / data_bw
    else:
        comm += gather * (2 * 4 * trained + 2 * trained) / data_bw
    if c.ep > 1:
        moe_layers = layers / cfg.moe_every
        bandwidth = a.intra_gbps if c.ep <= gpus_per_node else a.inter_gbps
        comm += c.accum * moe_layers * 4 * (c.ep - 1) / c.ep * cfg.experts_per_token * slice_bytes / (bandwidth * 1e9)
    if c.pp > 1:
        comm += 2 * (c.accum * slice_bytes * c.sp) / (a.inter_gbps * 1e9)  # forward activations, backward gradients
    if c.offload:
        partition = trained / (c.dp * c.sp)
        comm += (4 + 2) * partition / (a.pcie_gbps * 1e9) + partition / (a.cpu_adam_gparams * 1e9)
    return per_gpu + comm


def plan_layouts(cfg, gpus: int, gpus_per_node: int, global_batch: int, a: Assumptions) -> list[dict]:
    """Every candidate with its memory per GPU, fit, step time and MFU, the fastest fitting first."""
    if gpus % gpus_per_node and gpus > gpus_per_node:
        raise ConfigError(f"--gpus {gpus} is not a whole number of nodes of --gpus_per_node {gpus_per_node}")
    gpus_per_node = min(gpus_per_node, gpus)
    useful = flops_per_token(cfg) * global_batch * cfg.block_size
    rows = []
    for c in candidates(cfg, gpus, gpus_per_node, global_batch):
        try:
            planned = plan(cfg, c.ds_config(), gpus)
            check_experts(cfg, resolve_layout(c.ds_config(), gpus, c.pp, c.tp, c.sp, c.ep), c.zero, False, False, 1)
        except ConfigError:  # a layout train.py refuses (a stage without a block, experts where they cannot go)
            continue
        seconds = step_seconds(cfg, c, gpus_per_node, a)
        host = planned["cpu"] / (c.dp * c.sp) * gpus_per_node  # DeepSpeed's figure is a data group's
        rows.append({"layout": c, "memory": planned["total"], "parts": planned["parts"], "host": host,
                     "fits": fits(planned["total"], a.gpu_gb) and fits(host, a.host_gb), "seconds": seconds,
                     "mfu": useful / (gpus * a.peak_tflops * 1e12 * seconds)})
    if not rows:
        raise ConfigError(f"no layout of {global_batch} windows a step runs on {gpus} GPUs for this {cfg.arch} of "
                          f"{cfg.n_head} heads: change --global_batch or --gpus")
    return sorted(rows, key=lambda r: (not r["fits"], r["seconds"]))
