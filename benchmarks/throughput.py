"""Training throughput and MFU of the DeepSpeed engine, side by side with a plain-PyTorch reference.

    python benchmarks/throughput.py --config configs/baby_gpt.yaml --ds_config ds_configs/zero0.json
    python benchmarks/throughput.py --config configs/baby_gpt.yaml --ds_config ds_configs/zero2.json \
        --precisions bf16 fp32 --steps 30 model.dropout=0

For each precision, one process builds the same model twice (same seed): once inside the DeepSpeed engine
(the ds_config's ZeRO stage, clipping, AdamW and schedule, exactly as train.py does) and once for a
minimal loop: torch AdamW on fp32 weights, or for bf16/fp16 a low-precision copy for compute and fp32
master weights for the update, which is what DeepSpeed's bf16 optimizer does. Both see the same batches,
dropout seeds and learning rates; they take turns in chunks of steps, so a slow spell of the machine hits
both. After --warmup untimed steps, tokens/s is measured over --steps steps; MFU is model FLOP/s (training.metrics.
flops_per_token: 6N + 12 x layers x width x context per token) over train.py's peak for the device and
precision (training/device.py: a datasheet figure, train.peak_tflops, or a matmul peak measured here). Prints a
table and writes JSON (--json); --profile STEPS then profiles that many more steps of each loop and prints their
top operations by self time (a GPU's kernels, else the CPU's operators).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from deepspeed.accelerator import get_accelerator

from benchmarks.report import at_least, environment, load_inputs, print_table, results_file, run_main, write_json
from benchmarks.turns import profiled, timed_turns
from common.checks import ToolParser
from data.token_data import TokenData
from model import build_model, compile_blocks
from training.device import keep_freed_host_memory, onednn_matmuls, peak_flops, seed_step, set_kernels
from training.engines import train_step, training_engine
from training.launch.failure import join_process_group, leave_process_group
from training.launch.launcher_env import set_single_process_env
from training.metrics import flops_per_token
from training.objectives.next_token import NextToken
from training.optim import optimizer_and_schedule, param_groups
from training.steps import lm_loss
from training.topology import resolve_layout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Reference:
    """The minimal loop: forward, backward, clip, AdamW; fp32 master weights when computing in low precision."""

    def __init__(self, cfg, ds: dict, dtype: torch.dtype, device: torch.device):
        self.model = build_model(cfg.model, cfg.train.seed).to(device)
        self.compiled = cfg.train.compile  # the loss as train.py's objective computes it
        self.mixed = dtype != torch.float32
        names = [name for name, _ in self.model.named_parameters()]
        if self.mixed:  # the masters from the 16-bit weights, as DeepSpeed makes them once it has cast the model
            self.model.to(dtype)
            self.master = [p.detach().float().requires_grad_(True) for p in self.model.parameters()]
        else:
            self.master = list(self.model.parameters())
        adam = ds["optimizer"]["params"]
        self.optimizer = torch.optim.AdamW(param_groups(zip(names, self.master), cfg.optim.weight_decay),
                                           lr=adam["lr"], betas=adam["betas"], eps=adam["eps"],
                                           fused=adam.get("fused", False))
        self.clip = ds.get("gradient_clipping", 0.0)

    def step(self, micro_batches: list, lr: float) -> torch.Tensor:
        total = 0.0
        for inputs, targets in micro_batches:
            loss = lm_loss(self.model(inputs), targets, compiled=self.compiled)
            (loss / len(micro_batches)).backward()
            total += loss.detach()
        if self.mixed:
            for master, param in zip(self.master, self.model.parameters()):
                master.grad, param.grad = param.grad.float(), None
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.master, self.clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.mixed:
            with torch.no_grad():
                for master, param in zip(self.master, self.model.parameters()):
                    param.copy_(master)
        return total / len(micro_batches)


def measure(precision: str, args, cfg, ds_base: dict, data: TokenData, device: torch.device) -> dict:
    ds = json.loads(json.dumps(ds_base))
    ds.setdefault("bf16", {})["enabled"] = precision == "bf16"
    ds.setdefault("fp16", {})["enabled"] = precision == "fp16"
    ds.update(optimizer_and_schedule(cfg, ds))
    layout = resolve_layout(ds, 1, 1)
    attention = set_kernels(device, cfg.train, onednn_matmuls(ds, device, cfg.model.n_embd), DTYPES[precision],
                            cfg.model)  # the kernels as train.py picks them
    model = build_model(cfg.model, cfg.train.seed)
    engine = training_engine(model, cfg, ds)
    reference = Reference(cfg, ds, DTYPES[precision], device)
    if cfg.train.compile:  # as train.py does
        compile_blocks(model, cfg.model.arch)
        compile_blocks(reference.model, cfg.model.arch)
    objective = NextToken(compiled=cfg.train.compile)
    losses, lrs = {"deepspeed": [], "reference": []}, []

    def deepspeed_step(step: int) -> None:
        lrs.append(engine.get_lr()[0])
        losses["deepspeed"].append(train_step(engine, batches(step), objective))

    def reference_step(step: int) -> None:  # after the engine's step: it takes the engine's learning rate
        losses["reference"].append(reference.step(batches(step), lrs[step - 1]))

    def batches(step: int) -> list:
        seed_step(hash((cfg.train.seed, 0, step)) % 2**63, device)  # the same dropout masks for both
        return data.step_batches(cfg.train.seed, step, 0, layout, device)

    runners = {"deepspeed": deepspeed_step, "reference": reference_step}
    seconds = timed_turns(runners, args.warmup, args.steps, args.chunk)
    peak, peak_source = peak_flops(device, DTYPES[precision], cfg.train.peak_tflops, cfg.train.tf32)
    tokens_per_step = layout.global_batch * cfg.model.block_size
    result = {"precision": precision, "peak_tflops": peak / 1e12, "peak_source": peak_source,
              "tokens_per_step": tokens_per_step, "attention": attention}
    for name in runners:
        tokens_per_s = tokens_per_step * args.steps / seconds[name]
        result[name] = {"tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops_per_token(cfg.model) / peak,
                        "final_loss": sum(float(x) for x in losses[name][-5:]) / len(losses[name][-5:])}
    result["ratio"] = result["deepspeed"]["tokens_per_s"] / result["reference"]["tokens_per_s"]
    if args.profile:
        result["profile"] = profiled(runners, args.warmup + args.steps + 1, args.profile)
    return result


def main() -> None:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/baby_gpt.yaml")
    parser.add_argument("--ds_config", default="ds_configs/zero0.json")
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp32"], choices=DTYPES)
    parser.add_argument("--steps", type=int, default=20, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=5, help="steps each runner takes before the other's turn")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="then profile this many more steps of each: the top operators by self time")
    parser.add_argument("--json", default="out/benchmarks/throughput.json")
    parser.add_argument("overrides", nargs="*", help="run-config key=value (ds.* for the ds_config)")
    args = parser.parse_args()
    at_least(args, 1, "steps", "chunk")
    at_least(args, 0, "warmup", "profile")
    results_file(args.json)
    cfg, ds, data = load_inputs(args.config, args.ds_config, args.overrides)
    set_single_process_env()
    join_process_group()
    device = torch.device(get_accelerator().device_name(0))
    keep_freed_host_memory(device)  # as train.py does

    results = [measure(p, args, cfg, ds, data, device) for p in args.precisions]
    report = {**environment(device), "config": args.config, "ds_config": args.ds_config,
              "overrides": args.overrides, "zero_stage": ds.get("zero_optimization", {}).get("stage", 0),
              "steps": args.steps, "warmup": args.warmup, "flops_per_token": flops_per_token(cfg.model),
              "results": results}
    print(f"\n{args.config} with {args.ds_config} {' '.join(args.overrides)} on {report['device']}: "
          f"{args.steps} steps after {args.warmup} warm-up")
    rows = [[r["precision"], name, f"{r[name]['tokens_per_s']:,.0f}", f"{100 * r[name]['mfu']:.1f}%",
             f"{r['peak_tflops']:.3f}", f"{r[name]['final_loss']:.4f}",
             f"{r['ratio']:.3f}" if name == "deepspeed" else ""]
            for r in results for name in ("deepspeed", "reference")]
    print_table(["precision", "engine", "tokens/s", "MFU", "matmul peak TFLOP/s", "loss (last 5 steps)",
                 "DeepSpeed / reference"], rows)
    for r in results:
        for name, ops in r.get("profile", {}).items():
            print(f"\n{r['precision']} {name}: the top operators by self time over {args.profile} steps")
            print_table(["operator", "share", "ms/step", "calls/step"],
                        [[o["op"], f"{100 * o['share']:.1f}%", f"{o['ms_per_step']:.2f}", f"{o['calls_per_step']:g}"]
                         for o in ops])
    if len(results) > 1:
        first, second = results[0], results[1]
        print(f"{first['precision']} / {second['precision']} DeepSpeed tokens/s: "
              f"{first['deepspeed']['tokens_per_s'] / second['deepspeed']['tokens_per_s']:.2f}x")
    write_json(args.json, report)
    leave_process_group()


if __name__ == "__main__":
    run_main(main)
