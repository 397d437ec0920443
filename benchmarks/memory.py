"""Per-rank peak memory for each ZeRO stage at dp=2, next to the theory.

    python benchmarks/memory.py                       # GPT-2 124M, ZeRO 0/1/2/3 (low-memory) and ZeRO-2 + CPU offload
    python benchmarks/memory.py --config configs/gpt2_350m.yaml --nprocs 2 --stages zero2 zero3_lowmem

For each ds_config the script starts `deepspeed --num_gpus N` on itself; every rank builds the model as
train.py does, trains a few steps and records its memory: on GPU what the CUDA allocator has allocated, on
CPU its anonymous resident memory (sampled every few ms, with glibc made to return freed tensors at
once; code pages of libraries and shared-memory buffers are left out):
- baseline: before the model is built, with the engine's fixed cost paid (runtime, libraries, the modules
  and ops DeepSpeed loads, communication buffers);
- states kept between steps: after the first optimizer step (which allocates the optimizer state);
- gradients: what a backward pass leaves (ZeRO-0 to 2 free or shrink them after the step; they count);
- activations: what a forward pass adds, kept for the backward pass;
- peak: the highest level during the later steps (adds the backward pass's and the step's temporaries).
Model states measured = states kept + gradients, in memory and in live tensors (every tensor storage Python
can reach), set against the theory per rank for Ψ parameters in mixed precision with AdamW and N ranks, the
ZeRO paper's (K = 12): ZeRO-0 2Ψ + 2Ψ + 12Ψ bytes, ZeRO-1 2Ψ + 2Ψ + 12Ψ/N, ZeRO-2 2Ψ + (2Ψ + 12Ψ)/N,
ZeRO-3 (2Ψ + 2Ψ + 12Ψ)/N; fp32 training keeps 4Ψ weights and gradients and 8Ψ of Adam moments. Offload
moves ZeRO-2's 12Ψ/N to the host, with the buffers of OFFLOAD_HOST_BYTES: on a CPU machine host and
device are one memory, so they count there.
K = 12 leaves out one buffer that the peak holds: the optimizer step converts the 16-bit gradients to fp32
for the master-weight update, 4 bytes per parameter it steps at once (all of them without ZeRO, the rank's
partition with ZeRO-1/2, one `sub_group_size` sub-group with ZeRO-3; offload keeps that partition anyway).
DeepSpeed's own estimators count it (estimate_zero2_model_states_mem_needs: 2Ψ + 18Ψ/N), so the peak is
set against both. Prints a table, writes JSON.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import (
    DEEPSPEED,
    REPO,
    at_least,
    environment,
    load_inputs,
    print_table,
    results_file,
    run_main,
    run_tool,
    write_json,
)
from common.checks import ConfigError, ToolParser

# ZeRO-3 as zero3_lowmem.json by default: zero3.json's GPU-sized buckets (DeepSpeed's defaults) hold every
# parameter of a model this size gathered at once, which is not what ZeRO-3 is measured for here.
STAGES = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3_lowmem": 3, "zero2_offload": 2, "zero3": 3}
DEFAULT_STAGES = ["zero0", "zero1", "zero2", "zero3_lowmem", "zero2_offload"]
GB = 2**30


# CPU offload keeps on the host an fp32 copy of the rank's gradient partition, which the optimizer steps on, and a
# 16-bit copy of the updated weight partition on its way back to the device: bytes per parameter, over N ranks.
OFFLOAD_HOST_BYTES = {"zero2_offload": 4 + 2}


def theory_bytes(params: int, name: str, ranks: int, mixed: bool, sub_group_size: int) -> dict:
    """Model-state bytes per rank: weights, gradients, optimizer (fp32 master copy when mixed, Adam moments),
    and apart from them the fp32 gradients the mixed-precision step makes at once."""
    stage = STAGES[name]

    def shards(partitioned_from_stage: int) -> int:
        return ranks if stage >= partitioned_from_stage else 1

    weights = params * (2 if mixed else 4) / shards(3)
    grads = params * (2 if mixed else 4) / shards(2)
    optimizer = params * (12 if mixed else 8) / shards(1)
    offload = params * OFFLOAD_HOST_BYTES.get(name, 0) / ranks
    stepped_at_once = min(params / ranks, sub_group_size) if stage == 3 else params / shards(1)
    step_fp32_grads = 4 * stepped_at_once if mixed and name not in OFFLOAD_HOST_BYTES else 0
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "offload": offload,
            "total": weights + grads + optimizer + offload,
            "step_fp32_grads": step_fp32_grads}


class MemoryProbe:
    """Current and peak memory of this rank: the CUDA allocator's counters, or the resident set on CPU,
    sampled by a thread because the kernel's own high-water mark cannot be reset."""

    def __init__(self, device):
        self.device, self.peak = device, 0
        if device.type != "cuda":
            threading.Thread(target=self._sample, daemon=True).start()

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        with open("/proc/self/status") as f:  # anonymous memory: not the libraries' pages nor shared memory
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak = self.current()

    def peak_since_reset(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return max(self.peak, self.current())

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.current())
            time.sleep(0.002)


def live_tensor_bytes(device) -> int:
    """Bytes of every distinct tensor storage on `device` that Python can reach: the model states without
    the allocator's, the communication library's or the runtime's own memory."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == device.type:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
                continue
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def engine_runtime(ds: dict, device) -> None:
    """Pay the engine's fixed cost before the baseline is read: deepspeed.initialize and the first step import
    some 65 MB of modules (torch._dynamo among them) and load the communication and optimizer ops. That is
    runtime, the same for any model, so a one-parameter model takes it and is thrown away."""
    from training.engines import initialize

    tiny = torch.nn.Linear(1, 1, bias=False)
    engine = initialize(tiny, tiny.parameters(), ds)
    engine.backward(engine(torch.ones(1, 1, device=device, dtype=tiny.weight.dtype)).float().sum())
    engine.step()
    engine.destroy()
    del engine, tiny
    gc.collect()


def measured_step(engine, inputs, targets, probe, device) -> tuple[int, int, int]:
    """One optimizer step; returns what its forward pass added (activations kept for the backward pass) and what
    remained after the backward pass (gradients: those a stage frees after the step count too), in memory and in
    live tensors."""
    from training.steps import lm_loss

    before, tensors_before = probe.current(), live_tensor_bytes(device)
    loss = lm_loss(engine(inputs), targets)
    activations = probe.current() - before
    engine.backward(loss)
    gradients, gradient_tensors = probe.current() - before, live_tensor_bytes(device) - tensors_before
    engine.step()
    return activations, max(gradients, 0), max(gradient_tensors, 0)


def worker(args) -> None:
    """One rank under the launcher: build as train.py does, take steps, record memory."""
    from deepspeed.accelerator import get_accelerator

    from data.token_data import TokenData
    from training.config import load_run_config, split_overrides
    from training.ds_config import load_ds_config
    from training.engines import training_engine
    from training.launch.failure import join_process_group, leave_process_group
    from training.parallelize import parallelize
    from training.startup import effective_ds_config
    run_overrides, ds_overrides = split_overrides(args.overrides)
    cfg = load_run_config(args.config, run_overrides)
    ds = load_ds_config(os.path.join(REPO, "ds_configs", args.worker + ".json"), ds_overrides)
    data = TokenData(cfg.data.dir, cfg.data.tokenizer, cfg.model.block_size)
    cfg.model.vocab_size = cfg.model.vocab_size or data.meta["vocab_size"]
    join_process_group()
    rank = torch.distributed.get_rank()
    device = torch.device(get_accelerator().device_name(int(os.environ["LOCAL_RANK"])))
    get_accelerator().set_device(device.index or 0)
    engine_config = effective_ds_config(ds, cfg, int(os.environ["WORLD_SIZE"]), device)  # the ds_config train.py uses
    ds, layout = engine_config.ds, engine_config.layout
    probe = MemoryProbe(device)
    engine_runtime(ds, device)
    torch.distributed.barrier()
    baseline = probe.current()

    model, _ = parallelize(cfg, engine_config.pipe, ds)
    built = probe.current() - baseline
    engine = training_engine(model, cfg, ds)
    initialized = probe.current() - baseline

    def step(n: int) -> tuple[int, int, int]:
        inputs, targets = data.train_batch(cfg.train.seed, n, 0, rank, layout, device)
        return measured_step(engine, inputs, targets, probe, device)

    step(1)  # allocates the optimizer state
    gc.collect()  # tensors held only by reference cycles are garbage, not state
    torch.distributed.barrier()
    persistent, persistent_tensors = probe.current() - baseline, live_tensor_bytes(device)
    probe.reset_peak()
    activations, gradients, gradient_tensors = map(max, zip(*(step(n) for n in range(2, 2 + args.steps))))
    peak = probe.peak_since_reset()
    record = {"rank": rank, "baseline": baseline, "after_build": built, "after_initialize": initialized,
              "persistent": persistent, "gradients": gradients, "states": persistent + gradients,
              "states_in_tensors": persistent_tensors + gradient_tensors, "activations": activations, "peak": peak,
              "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
              "mixed": ds.get("bf16", {}).get("enabled", False) or ds.get("fp16", {}).get("enabled", False),
              "sub_group_size": engine.zero_sub_group_size()}
    records = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(records, record)
    if rank == 0:
        with open(args.record, "w") as f:
            json.dump(records, f)
    leave_process_group()


def check(args) -> None:
    """What every rank will read, checked once before the first launch: the run config, the dataset, and each
    stage's ds_config, which must give one micro-batch per step."""
    from training.topology import resolve_layout

    at_least(args, 1, "nprocs", "steps")
    results_file(args.json)
    for name in args.stages:
        _, ds, _ = load_inputs(args.config, f"ds_configs/{name}.json", args.overrides, REPO)
        accum = resolve_layout(ds, args.nprocs, 1).grad_accum
        if accum != 1:
            raise ConfigError(f"ds_configs/{name}.json gives {accum} micro-batches per step at --nprocs "
                              f"{args.nprocs}: the memory benchmark measures one; fix: set "
                              f"ds.gradient_accumulation_steps=1")


def parse_args() -> argparse.Namespace:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/gpt2_124m.yaml")
    parser.add_argument("--stages", nargs="+", default=DEFAULT_STAGES, choices=list(STAGES))
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="steps measured after the first")
    parser.add_argument("--json", default="out/benchmarks/memory.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a rank of one measurement, under the launcher
    parser.add_argument("--record", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the launcher
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. model.block_size=256 (ds.* for the ds_config)")
    return parser.parse_args()


def measure_stage(name: str, args) -> dict:
    """One ds_config's ranks under the launcher: their records, and the worst rank's against the theory."""
    fd, record = tempfile.mkstemp(prefix=f"memory_{name}_", suffix=".json")  # rank 0 hands the ranks' figures
    os.close(fd)  # back through it; they all go into --json
    cmd = [*DEEPSPEED, "--num_gpus", str(args.nprocs),
           os.path.abspath(__file__), "--worker", name, "--record", record, "--config", args.config,
           "--steps", str(args.steps), *args.overrides]
    print(" ".join(cmd), flush=True)
    # A fixed mmap threshold makes glibc hand freed tensors back at once: otherwise the resident set of a CPU
    # rank keeps memory that torch already freed, and the CPU figures would not be comparable to a GPU's.
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nprocs)),
           "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072"),
           "MALLOC_TRIM_THRESHOLD_": "0"}
    run_tool(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    with open(record) as f:
        ranks = json.load(f)
    os.remove(record)
    worst = max(ranks, key=lambda r: r["peak"])
    theory = theory_bytes(worst["params"], name, args.nprocs, worst["mixed"], worst["sub_group_size"])
    expected_peak = worst["baseline"] + theory["total"] + worst["activations"]
    return {"ranks": ranks, "theory": theory, "states_vs_theory": worst["states"] / theory["total"] - 1,
            "tensors_vs_theory": worst["states_in_tensors"] / theory["total"] - 1,
            "peak_vs_baseline_theory_activations": worst["peak"] / expected_peak - 1,
            "peak_vs_with_step_fp32_grads": worst["peak"] / (expected_peak + theory["step_fp32_grads"]) - 1}


def print_results(args, results: dict) -> None:
    rows = []
    for name, result in results.items():
        worst, theory = max(result["ranks"], key=lambda r: r["peak"]), result["theory"]
        rows.append([name, *(f"{worst[k] / GB:.2f}" for k in ("peak", "baseline", "activations", "states",
                                                             "states_in_tensors")),
                     *(f"{theory[k] / GB:.2f}" for k in ("total", "step_fp32_grads")),
                     *(f"{100 * result[k]:+.1f}%" for k in ("states_vs_theory", "tensors_vs_theory",
                                                            "peak_vs_baseline_theory_activations",
                                                            "peak_vs_with_step_fp32_grads"))])
    print(f"\n{args.config} {' '.join(args.overrides)}, dp={args.nprocs}: GiB per rank "
          f"(the rank with the highest peak)")
    print_table(["ds_config", "peak", "baseline", "activations", "model states: memory", "model states: live tensors",
                 "model states: theory", "step's fp32 gradients", "memory vs theory", "tensors vs theory",
                 "peak vs baseline + theory + activations", "the same + step's fp32 gradients"], rows)
    zero3 = next((name for name in results if STAGES[name] == 3), None)
    if "zero0" in results and zero3:
        for measure in ("states", "states_in_tensors"):
            ratio = (max(r[measure] for r in results[zero3]["ranks"])
                     / max(r[measure] for r in results["zero0"]["ranks"]))
            print(f"ZeRO-3 ({zero3}) / ZeRO-0 model states per rank, {measure.replace('_', ' ')}: {ratio:.1%}")
        print(f"ZeRO-3 / ZeRO-0 model states per rank, theory: "
              f"{results[zero3]['theory']['total'] / results['zero0']['theory']['total']:.1%}")


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    check(args)

    from deepspeed.accelerator import get_accelerator

    results = {name: measure_stage(name, args) for name in args.stages}
    print_results(args, results)
    device = torch.device(get_accelerator().device_name(0))
    write_json(args.json, {**environment(device), "config": args.config, "overrides": args.overrides,
                           "nprocs": args.nprocs, "results": results})


if __name__ == "__main__":
    run_main(main)
