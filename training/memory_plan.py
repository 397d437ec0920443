"""Per-GPU memory plan for a preset under each ds_config layout: model states plus activations (the command:
scripts/memory_plan.py).

Model states follow the optimizer DeepSpeed picks for 16-bit mixed precision with AdamW (model_states): what
stays between steps, and the gradients the backward pass leaves for the step, which come as the activations go, so
the total is the states and the larger of the two. Activations use Megatron-LM's count
(Korthikanti et al. 2022) with flash attention, so no sequence-squared term: per layer and token,
18 x d_model + 4 x ffn bytes in 16-bit (Llama: less for grouped-query k and v, 8 x ffn for SwiGLU;
2 x d_model when the layer is checkpointed, and its matmuls' and attention's outputs under selective
recomputation: selective_layer_bytes), of which 2 x d_model are the two residual dropout masks
(1 byte an element; none without dropout), plus the logits: 16-bit logits and their gradient (4 bytes per
vocabulary entry and token) and the loss's fp32 chunk of LOSS_CHUNK_ROWS tokens (activation_bytes; none under
train.compile, whose kernels read the 16-bit logits).
A pipeline stage in DeepSpeed's 1F1B schedule holds up to min(stages, micro-batches) micro-batches.
Under tensor parallelism (degree t, no sequence parallelism) a rank holds its slice of each split weight and
every replicated one whole, and per layer and token 8 x d_model replicated bytes (the norms' inputs and the
column-parallel maps' inputs) plus the masks, and the rest divided by t: Megatron's 10 d + 24 d / t for the
GPT; the logits are split by vocabulary. Under Megatron's sequence parallelism inside the tensor groups
(ds_config tensor_sequence_parallel) those replicated bytes and the masks are split by sequence instead, so a rank
keeps all of it divided by t (Megatron's 34 d / t for the GPT), and t times fewer checkpointed block inputs.
Under sequence parallelism (degree s, Ulysses) a rank holds 1/s of each window's tokens, so every per-token term
divides by s (attention runs over the whole window for 1/s of the heads: as many values), and ZeRO partitions
over the data x sequence ranks.
Under document masking the GPU's FlexAttention keeps no T x T mask; the dense kernel (attention dropout, or
the CPU) keeps each block's mask for its backward, converted to the compute dtype: T x 2 bytes per token in
16-bit, whole on every tensor rank; the Llama keeps its RoPE tables per token (document_masking_bytes,
measured by benchmarks/documents.py).
A mixture-of-experts block (model/moe.py) keeps, per token, what k of its experts keep (8 x expert width each,
SwiGLU), each route's dispatched input and expert output (2 d each) and the router's fp32 probabilities (4 E),
counted as if the routing were even, and what its shared expert keeps (8 x its width, its output, 2 d, for the
product with its gate's sigmoid, and that sigmoid, 2 bytes); a rank holds n_experts / expert_parallel_size
experts, whose optimizer states ZeRO partitions over the ranks that hold the same experts (dp / ep), and the
shared expert whole. LoRA's adapters keep their r-wide products, and under model.lora_dropout each map's dropped
input and mask (adapter_bytes).
ZeRO-3 adds its gradient bucket, allocated whole at start; ZeRO-1/2 allocate theirs at each backward pass.
Allocator fragmentation and the CUDA context come on top. At ZeRO-0 to 2 the plan is within 5% of a step's peak
of live tensors (tests/test_gpu_probes.py); under ZeRO-3 a GPU's peak ran above this count of the activations while
ZeRO-3 computed in fp32 (docs/performance.md, "The memory plan on a GPU").
"""
import dataclasses
from dataclasses import dataclass

import torch
from deepspeed.moe.utils import is_moe_param
from deepspeed.pipe import TiedLayerSpec
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from model import ExpertParallel, architecture, model_layers
from model.documents import document_kernel
from model.lora import LoRALinear
from model.tensor_parallel import ROW, TensorParallel
from training.moe import expert_parallel_size
from training.steps import LOSS_CHUNK_ROWS
from training.topology import (
    pipeline_settings,
    resolve_layout,
    sequence_parallel_size,
    stage_partition,
    tensor_parallel_size,
)

GB = 2**30


# Of a GPU's memory, what the plan leaves to what it does not count: the allocator's fragmentation, the
# communication library's buffers, the CUDA context.
ALLOWANCE = 0.10


def fits(total_bytes: float, gpu_gb: float) -> bool:
    """Whether a plan's figure fits a GPU of `gpu_gb` beside the ALLOWANCE."""
    return total_bytes < (1 - ALLOWANCE) * gpu_gb * GB


def layer_params(cfg, tp_size: int = 1, ep_size: int = 1, experts: bool | None = None,
                 trainable: bool = False) -> list[int]:
    """Parameters of each layer as one tensor-parallel (and expert-parallel) rank holds them; `experts` True or
    False: only the experts' parameters, or only the others; `trainable`: only those that train (LoRA's
    adapters, where model.lora_rank freezes the rest)."""
    def count() -> tuple[int, ...]:
        with torch.device("meta"):
            specs = model_layers(cfg, TensorParallel(tp_size), ExpertParallel(ep_size))
            return tuple(sum(p.numel() for p in spec.build().parameters()
                             if (experts is None or is_moe_param(p) == experts) and (p.requires_grad or not trainable))
                         for spec in specs)
    return list(_once(("params", repr(cfg), tp_size, ep_size, experts, trainable), count))


def stages_of(cfg, tp_size: int, stages: int, method: str) -> tuple[list, list[int]]:
    """The layer specs at this tensor-parallel degree and PipelineModule's stage boundaries."""
    def partition() -> tuple[list, list[int]]:
        specs = model_layers(cfg, TensorParallel(tp_size))
        return specs, stage_partition(specs, stages, method, architecture(cfg).block)
    return _once(("stages", repr(cfg), tp_size, stages, method), partition)


_COUNTED: dict = {}  # the layout planner asks for the same model's counts again and again


def _once(key: tuple, make):
    if key not in _COUNTED:
        _COUNTED[key] = make()
    return _COUNTED[key]


def document_masking_bytes(cfg, device_type: str = "cuda", dtype_bytes: int = 2) -> int:
    """Bytes per token a block keeps for document masking: with the dense kernel, its mask's row of block_size
    entries (scaled_dot_product_attention saves the boolean mask converted to the compute dtype); for the
    Llama, cos and sin gathered at each token's position (head_dim entries each) instead of one shared table."""
    if not cfg.document_masking:
        return 0
    mask = cfg.block_size if document_kernel(device_type, cfg.dropout) == "dense" else 0
    rope = 2 * cfg.head_width if architecture(cfg).rope else 0
    return (mask + rope) * dtype_bytes


def layer_activation_bytes(cfg, tp_size: int = 1, mlp_tiles: int = 1, sequence_split: bool = False,
                           device_type: str = "cuda", compiled: bool = False) -> float:
    """16-bit bytes a block keeps per token for its backward on one tensor rank. Megatron's 18 d counts q, k
    and v at 2 d each: grouped-query attention keeps k and v at kv_heads x head_dim, and q and the attention's output
    are n_head x head_dim wide (model.head_dim); Qwen3's per-head norms keep their inputs and each head's fp32 scale
    (a CPU's RMSNorm 6 bytes an element more, as below). The GPT's MLP keeps its
    hidden input and GeLU output (4 x ffn); SwiGLU keeps the gate, its SiLU, up and their product (8 x ffn),
    compiled (train.compile) all but the SiLU, which inductor's partitioner recomputes in the backward pass
    (6 x ffn: on an H200, 4.50 GiB less for Llama-124M at 64 x 1,024 tokens, 2 x 3,072 x 12 layers' worth); in
    tiles (train.mlp_tiles) it keeps only its input, the second norm's output, counted already.
    The two norms' inputs and outputs (8 d) and the dropout masks are whole on every tensor rank, the rest is
    split; with the sequence split (Megatron's sequence parallelism) all of it is, but the document mask and the
    RoPE tables of the attention, which sees the whole sequence. On a CPU torch's RMSNorm keeps an fp32 copy of its
    input in place of the 16-bit one and the normalized fp32 rows beside the 16-bit ones: 6 bytes an element more,
    two norms a block (the live tensors of a CPU step, 2 and 12 layers of Llama-124M)."""
    kv, arch = cfg.kv_heads * cfg.head_width, architecture(cfg)
    cpu_norm = 6 if arch.rms_norm and device_type == "cpu" else 0  # bytes an element a CPU's RMSNorm keeps more
    masks = 2 * cfg.n_embd if cfg.dropout > 0 else 0
    swiglu = 6 if compiled else 8
    mlp = 0 if mlp_tiles > 1 else (swiglu if arch.mlp_matrices == 3 else 4) * arch.mlp_hidden(cfg)
    if cfg.n_experts:  # the larger of the two kinds of block, when only every moe_every-th has experts
        routes = cfg.experts_per_token * (8 * arch.expert_hidden(cfg) + 4 * cfg.n_embd)
        shared = 8 * arch.shared_hidden(cfg) + (2 * cfg.n_embd + 2 if cfg.n_shared_experts else 0)
        mlp = max(mlp if cfg.moe_every > 1 else 0, routes + 4 * cfg.n_experts + shared)
    qk_norms = (2 + cpu_norm) * (cfg.q_width + kv) + 4 * (cfg.n_head + cfg.kv_heads) if cfg.qk_norm else 0
    split = 4 * cfg.q_width + 4 * kv + mlp + qk_norms
    whole = (8 + 2 * cpu_norm) * cfg.n_embd + masks
    if sequence_split:
        whole, split = 0, whole + split
    return whole + document_masking_bytes(cfg, device_type) + split / tp_size


def selective_layer_bytes(cfg, tp_size: int = 1, sequence_split: bool = False, compiled: bool = False) -> float:
    """Bytes a block keeps per token under selective recomputation (model/recompute.py) besides its input: the
    outputs of its matmuls and attention, on every device alike (what it recomputes, the norms, RoPE, dropout and
    the document mask among them, it does not keep). q, k and v; attention's output and each head's fp32 log-sum-exp;
    the MLP's hidden matmul outputs (SwiGLU: two); split by the tensor ranks. The outputs of the attention's and the
    MLP's projections (2 d each) on one rank, compiled (train.compile) the attention's alone: inductor's partitioner
    leaves out the MLP's, which no backward needs; under tensor parallelism neither is kept.
    A mixture-of-experts block is counted as it is unchecked (layer_activation_bytes), a bound from above."""
    arch = architecture(cfg)
    if cfg.n_experts:
        return layer_activation_bytes(cfg, tp_size, 1, sequence_split) - 2 * cfg.n_embd
    hidden = 2 * (arch.mlp_matrices - 1) * arch.mlp_hidden(cfg)
    split = 2 * cfg.q_width + 4 * cfg.kv_heads * cfg.head_width + 2 * cfg.q_width + 4 * cfg.n_head + hidden
    return split / tp_size + ((2 if compiled else 4) * cfg.n_embd if tp_size == 1 else 0)


def adapted_maps(cfg, tp_size: int = 1) -> tuple[tuple[str | None, int, int], ...]:
    """(split, inputs, outputs) on one tensor rank of each linear map LoRA adapts in a block (model.lora_rank; of
    the block with the most, where blocks differ)."""
    def maps() -> tuple:
        block, found = architecture(cfg).block, [()]
        with torch.device("meta"):
            for spec in model_layers(cfg, TensorParallel(tp_size)):
                if spec.typename is block:
                    found.append(tuple((m.split, m.in_features, m.out_features) for m in spec.build().modules()
                                       if isinstance(m, LoRALinear)))
        return max(found, key=len)
    return _once(("adapted", repr(cfg), tp_size), maps) if cfg.lora_rank else ()


def adapter_bytes(cfg, tp_size: int = 1, device_type: str = "cuda", selective: bool = False) -> float:
    """16-bit bytes per token a block's adapters keep beside its frozen maps. Unchecked: each map's r-wide x A^T,
    which B's gradient reads; under model.lora_dropout also the dropped copy of its input, which A's gradient reads,
    and the mask (1 byte an element where F.dropout's GPU kernel keeps a boolean one; 2 on a CPU, and for a
    row-split map, whose mask is drawn whole and a slice kept). A bound: where nothing else keeps a map's input
    (a norm's output, which a norm's backward does not read), the dropped copy takes its place, 2 bytes an element
    fewer (on a CPU, a GPT 64 wide: 1,024 bytes a block where this counts 1,792). Under selective recomputation, the
    adapters' matmul outputs, x A^T and its product with B, of each map not row-split (a row-split map's run again,
    model/recompute.py's `recomputed`); under full recomputation, none."""
    maps, rank = adapted_maps(cfg, tp_size), cfg.lora_rank
    if selective:
        return sum(2 * rank + 2 * outputs for split, _, outputs in maps if split != ROW)
    dropped = 0
    if cfg.lora_dropout:
        dropped = sum((2 + (1 if device_type == "cuda" and split != ROW else 2)) * inputs for split, inputs, _ in maps)
    return 2 * rank * len(maps) + dropped


def repeated_ties(specs: list) -> list[int]:
    """Indexes of TiedLayerSpecs that reuse an earlier layer's weights (the GPT's LM head)."""
    seen, repeats = set(), []
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            (repeats.append(i) if spec.key in seen else seen.add(spec.key))
    return repeats


def bf16_optimizer(ds: dict, stage: int, offload: bool, pipelined: bool) -> bool:
    """Does DeepSpeed wrap the optimizer in its BF16_Optimizer (engine._do_optimizer_sanity_check): bf16 weights
    under ZeRO-1 with fp32 gradient accumulation and no offload, or under the pipeline engine? It keeps an fp32
    gradient for every weight, and partitions the master weights and moments alone."""
    bf16 = ds.get("bf16", {}).get("enabled", False) in (True, "auto")
    return bf16 and ((stage == 1 and grad_accum_bytes(ds) == 4 and not offload) or (pipelined and stage <= 1))


def grad_accum_bytes(ds: dict) -> int:
    return 4 if ds.get("data_types", {}).get("grad_accum_dtype") in ("fp32", "float32") else 2


def gradient_buckets(ds: dict, stage: int) -> int:
    """Bytes of the gradient buckets ZeRO allocates with contiguous gradients, reduce_bucket_size elements each
    (DeepSpeed's estimators leave them out). ZeRO-3: one of the communication dtype, whole from the start (the
    shipped zero3.json's 500M fp32 elements are 1.86 GiB, whatever the model's size). ZeRO-1/2: one at each
    backward pass (DeepSpeed's setup_buckets; two with overlap_comm), of the gradient accumulation dtype under
    ZeRO-1 and the 16-bit dtype under ZeRO-2; it comes after the loss's fp32 chunk is freed."""
    zero = ds.get("zero_optimization", {})
    if stage == 0 or not zero.get("contiguous_gradients", True):
        return 0
    elements = int(float(zero.get("reduce_bucket_size", 5e8)))
    if stage == 3:
        comm = ds.get("communication_data_type") or ("bf16" if ds.get("bf16", {}).get("enabled") else "fp32")
        return elements * (4 if comm in ("fp32", "float32") else 2)
    return elements * (grad_accum_bytes(ds) if stage == 1 else 2) * (2 if zero.get("overlap_comm") else 1)


@dataclass(frozen=True)
class ModelStates:
    """Bytes a GPU keeps between steps (weights, gradients, optimizer: master weights and moments, and ZeRO-3's
    gradient bucket, allocated whole at start); what the backward pass and the optimizer step add once the
    activations are gone (`step`: the 16-bit gradients, the step's fp32 copy of them); the gradient bucket ZeRO-1/2
    allocate for each backward pass beside the activations; and host bytes under offload."""
    weights: float
    gradients: float = 0
    optimizer: float = 0
    bucket: float = 0
    step: float = 0
    backward_bucket: float = 0
    cpu: float = 0

    @property
    def kept(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.bucket


def model_states(params: float, stage: int, dp: int, ds: dict, offload: bool, pipelined: bool,
                 largest_layer: int) -> ModelStates:
    """The states of `params` parameters on one GPU, ZeRO partitioning over `dp` ranks."""
    if bf16_optimizer(ds, stage, offload, pipelined):  # 16-bit weights, gradient accumulators; partitioned states
        return ModelStates(2 * params, grad_accum_bytes(ds) * params, 12 * params / dp, step=2 * params)
    if pipelined:  # fp16 under the pipeline engine: ZeRO-0/1 within each stage's data-parallel group
        shards = dp if stage == 1 else 1
        return ModelStates(2 * params, 2 * params + 4 * params / shards, 12 * params / shards)
    if stage == 0:  # DeepSpeed's FP16_Optimizer: 16-bit gradients after the backward pass, fp32 ones in the step
        return ModelStates(2 * params, 0, 12 * params, step=6 * params)
    if stage == 1:
        return ModelStates(2 * params, 2 * params + 4 * params / dp, 12 * params / dp,
                           backward_bucket=gradient_buckets(ds, 1))
    if stage == 2 and not offload:  # the gradients' partitions exist from the backward pass to the step
        return ModelStates(2 * params, 0, 12 * params / dp, step=6 * params / dp,
                           backward_bucket=gradient_buckets(ds, 2))
    if stage == 2:
        cpu, gpu = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=dp, cpu_offload=True)
        return ModelStates(gpu, backward_bucket=gradient_buckets(ds, 2), cpu=cpu)
    if offload:  # a partition of the 16-bit weights and the largest layer gathered
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(params, largest_layer, num_gpus_per_node=dp,
                                                            cpu_offload=True, cpu_offload_params=False)
        return ModelStates(gpu, bucket=gradient_buckets(ds, 3), cpu=cpu)
    # 16 bytes a parameter over the ranks, as measured (DeepSpeed's estimator says 18, fp32 gradients): the 16-bit
    # weights and gradients, fp32 master weights and moments; the largest layer gathered in 16 bits; and at the step
    # an fp32 copy of a sub-group's gradients
    sub_group = int(float(ds.get("zero_optimization", {}).get("sub_group_size", 1e9)))
    return ModelStates(2 * params / dp + 2 * largest_layer, 2 * params / dp, 12 * params / dp,
                       step=4 * min(params / dp, sub_group), bucket=gradient_buckets(ds, 3))


def plan(cfg, ds: dict, gpus: int, mlp_tiles: int = 1, device_type: str = "cuda", compiled: bool = False) -> dict:
    """Bytes per GPU (the busiest one) for this model, ds_config and GPU count (and train.mlp_tiles, train.compile;
    on a CPU, device_type "cpu"): the model states kept, and the larger of the activations (with what runs beside them)
    and the gradients the backward pass leaves for the step."""
    pipe, tp_size, sp_size = pipeline_settings(ds), tensor_parallel_size(ds), sequence_parallel_size(ds)
    ep_size = expert_parallel_size(ds)
    layout = resolve_layout(dict(ds), gpus, pipe.stages, tp_size, sp_size, ep_size)
    counts = layer_params(cfg, tp_size, ep_size)
    specs, parts = stages_of(cfg, tp_size, pipe.stages, pipe.partition)
    zero = ds.get("zero_optimization", {})
    stage, offload = zero.get("stage", 0), zero.get("offload_optimizer", {}).get("device", "none") != "none"

    def held(counts: list[int]) -> int:  # by the busiest stage; the tied head owns no weights
        if pipe.stages > 1:
            return max(sum(counts[parts[s]: parts[s + 1]]) for s in range(pipe.stages))
        return sum(counts) - sum(counts[i] for i in repeated_ties(specs))

    dp = layout.data_axis  # ZeRO partitions over the data-parallel replicas and their sequence ranks
    partitioned = stage == 3 and pipe.stages == 1
    every = held(counts)
    local = every / dp if partitioned else every
    trained = held(layer_params(cfg, tp_size, ep_size, trainable=True)) if cfg.lora_rank else every
    states = model_states(trained, stage, dp, ds, offload, pipe.stages > 1, max(counts))
    if trained < every:  # frozen weights: 16 bits each, without gradients or optimizer states
        frozen = (every - trained) * 2 / (dp if partitioned else 1)
        states = dataclasses.replace(states, weights=states.weights + frozen)
    if cfg.n_experts and not cfg.lora_rank and ep_size > 1 and 1 <= stage <= 2 and pipe.stages == 1:
        # The experts' fp32 gradients and optimizer states are partitioned over their dp / ep copies, not over dp.
        more = sum(layer_params(cfg, tp_size, ep_size, experts=True)) * (1 / (dp // ep_size) - 1 / dp)
        states = dataclasses.replace(states, gradients=states.gradients + 4 * more,
                                     optimizer=states.optimizer + 12 * more)
    activations, loss_chunk = activation_bytes(cfg, layout, pipe, specs, parts, tp_size, sp_size, mlp_tiles,
                                               device_type, compiled)
    backward = activations + max(loss_chunk, states.backward_bucket)
    return {"layout": layout.describe().split(";")[0], "zero": f"{stage}{' + CPU offload' if offload else ''}",
            "params_per_gpu": local, "states": states.kept, "gradients": states.step, "activations": backward,
            "total": states.kept + max(backward, states.step), "cpu": states.cpu, "micro": layout.micro_batch,
            "parts": parts_of(states, activations + loss_chunk, backward)}


PARTS = ("weights", "gradients", "optimizer", "buffers", "activations")  # the plan's parts, as the planner prints them


def parts_of(states: ModelStates, activations: float, backward: float) -> dict:
    """The plan's total in parts that add up to it: weights, gradients and optimizer states kept between steps;
    the gradient buckets (ZeRO-3's, and ZeRO-1/2's as far as it outgrows the loss's chunk it comes after); and the
    activations with the loss, or where larger the gradients the optimizer step makes."""
    peak_in_backward = backward >= states.step
    return dict(zip(PARTS, (states.weights, states.gradients, states.optimizer,
                            states.bucket + (backward - activations if peak_in_backward else 0),
                            activations if peak_in_backward else states.step)))


def activation_bytes(cfg, layout, pipe, specs, parts, tp_size, sp_size, mlp_tiles, device_type,
                     compiled) -> tuple[float, float]:
    """The forward pass's peak: each block's saved tensors for the micro-batches in flight, the logits and their
    gradient; and apart, the loss's fp32 chunk (torch's log-softmax converts the chunk to fp32 and writes its fp32
    result: 8 bytes an entry; 6 over a vocabulary split by tensor ranks, whose loss shifts and exponentiates one
    fp32 copy in place, and returns an fp32 gradient cast to 16 bits; none where inductor's kernels make one rank's
    loss straight from the 16-bit logits), which ZeRO-1/2's bucket comes after."""
    tokens = layout.micro_batch * cfg.block_size // sp_size
    full_layer = tokens * (layer_activation_bytes(cfg, tp_size, mlp_tiles, layout.tp_sequence, device_type, compiled)
                           + adapter_bytes(cfg, tp_size, device_type))
    kept = 0  # what a checkpointed block keeps beside its input; in the backward pass, it makes the rest again
    if pipe.checkpoint_interval and pipe.recompute == "selective":
        kept = tokens * (selective_layer_bytes(cfg, tp_size, layout.tp_sequence, compiled)
                         + adapter_bytes(cfg, tp_size, device_type, selective=True))
    block_input = tokens * 2 * cfg.n_embd / (tp_size if layout.tp_sequence else 1)
    per_layer = block_input + kept if pipe.checkpoint_interval else full_layer
    block = architecture(cfg).block
    blocks = max(sum(spec.typename is block for spec in specs[parts[s]: parts[s + 1]]) for s in range(pipe.stages))
    in_flight = min(pipe.stages, layout.grad_accum) if pipe.stages > 1 else 1
    activations = in_flight * blocks * per_layer + (full_layer - kept if pipe.checkpoint_interval else 0)
    entry_bytes = 6 if tp_size > 1 else 0 if compiled else 8
    loss_chunk = entry_bytes * min(tokens, LOSS_CHUNK_ROWS) * cfg.padded_vocab_size / tp_size
    return activations + 4 * tokens * cfg.padded_vocab_size / tp_size, loss_chunk


if __name__ == "__main__":
    from common.checks import not_a_command

    not_a_command("training.memory_plan", "python -m scripts.memory_plan")
