"""What a run measures: model FLOPs per token, tokens/s and MFU, and the metrics sink (the device's peak
and memory are in training/device.py)."""
import json
import os
import time

import torch

from model import architecture, build_model
from model.config import ModelConfig
from model.lora import is_adapter


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (PaLM appendix B): 6 x the weights used in matmuls (per layer: the query
    and output projections 2 d x n_head x head_dim (2d^2 where head_dim is d / n_head), the key and value
    projections 2 d x kv_heads x head_dim, which grouped-query attention shrinks, and the MLP's 2 or, for SwiGLU, 3
    matrices of d x ffn; plus the vocabulary head, or a score head's d) for forward and backward, plus 12 x n_layer
    x n_head x head_dim x block_size for the attention score and value matmuls (every query head attends).
    Biases, norms, RoPE and the embedding lookup are left out. The same formula holds for the GPT, Llama and the
    encoder stack. A mixture-of-experts block counts its active weights: the router's d x n_experts,
    experts_per_token experts, and the shared expert (every token's) with its gate's d. Under LoRA the frozen
    weights count 4 x and the adapters 6 x."""
    d, layers, arch = cfg.n_embd, cfg.n_layer, architecture(cfg)
    attention = 2 * d * cfg.q_width + 2 * d * cfg.kv_heads * cfg.head_width
    dense_mlp = arch.mlp_matrices * d * arch.mlp_hidden(cfg)
    shared = arch.mlp_matrices * d * arch.shared_hidden(cfg) + (d if cfg.n_shared_experts else 0)
    moe_mlp = d * cfg.n_experts + cfg.experts_per_token * arch.mlp_matrices * d * arch.expert_hidden(cfg) + shared
    mlps = sum(moe_mlp if cfg.is_moe_block(i) else dense_mlp for i in range(layers))
    head = cfg.padded_vocab_size if cfg.head == "lm" else 1  # a score head (model.head=score) has one output
    matmul_weights = layers * attention + mlps + head * d
    scores = 12 * layers * cfg.q_width * cfg.block_size
    if cfg.lora_rank:  # no gradient is made for a frozen weight: its forward and its input's gradient, 4 x
        return 4 * matmul_weights + 6 * adapter_params(cfg) + scores
    return 6 * matmul_weights + scores


def adapter_params(cfg: ModelConfig) -> int:
    """LoRA's adapters' parameters (model.lora_rank), counted on the meta device, each a matmul's weight."""
    key = repr(cfg)
    if key not in _ADAPTERS:
        with torch.device("meta"):
            _ADAPTERS[key] = sum(p.numel() for name, p in build_model(cfg).named_parameters() if is_adapter(name))
    return _ADAPTERS[key]


_ADAPTERS: dict = {}  # the layout planner asks for the same model's count again and again


class Throughput:
    """Tokens/s and MFU over the steps since the last read; pause() leaves out time that is not training."""

    def __init__(self, tokens_per_step: int, flops_per_step_per_device: float, peak_flops: float):
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step_per_device
        self.peak_flops = peak_flops
        self.pause()

    def pause(self) -> None:
        self.start, self.steps = time.perf_counter(), 0

    def step(self) -> None:
        self.steps += 1

    def read(self) -> tuple[float | None, float | None]:
        if not self.steps:
            return None, None
        elapsed = time.perf_counter() - self.start
        tokens_per_s = self.tokens_per_step * self.steps / elapsed
        mfu = self.flops_per_step * self.steps / elapsed / self.peak_flops
        self.pause()
        return tokens_per_s, mfu


class MetricsLog:
    """One JSON object per line in <out_dir>/metrics.jsonl, plus DeepSpeed's own monitors (wandb,
    TensorBoard, CSV: whichever the ds_config enables). Only global rank 0 writes.

    The engine writes its own monitor events (Train/Samples/lr, ...) against samples seen, and wandb drops
    any event whose x value is below one already logged; so ours go against samples too (step x global
    batch), with the step as a value of its own."""

    def __init__(self, out_dir: str, monitor, is_writer: bool, append: bool, samples_per_step: int):
        self.is_writer = is_writer
        self.monitor = monitor
        self.samples_per_step = samples_per_step
        self.file = None
        if is_writer:
            path = os.path.join(out_dir, "metrics.jsonl")
            if os.path.exists(path) and not append:  # an earlier run's record is kept, never overwritten
                n = 1
                while os.path.exists(f"{path}.{n}"):
                    n += 1
                os.replace(path, f"{path}.{n}")
                print(f"kept the earlier {path} as {path}.{n}")
            self.file = open(path, "a" if append else "w")

    def log(self, step: int, **values) -> None:
        if not self.is_writer:
            return
        values = {k: v for k, v in values.items() if v is not None}  # a measure with nothing to report is left out
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.monitor is not None and self.monitor.enabled:
            samples = step * self.samples_per_step
            self.monitor.write_events([(f"train/{k}", v, samples) for k, v in {"step": step, **values}.items()])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
