"""How long a checkpoint save stops the training loop: synchronous against written in the background.

    python benchmarks/checkpoint_stall.py                          # baby_gpt, gpt2_124m, llama_124m shapes
    python benchmarks/checkpoint_stall.py --presets baby_gpt --saves 5

One process per preset builds the engine as train.py does (the ds_config's ZeRO stage, bf16 unless
--precision fp32) on the character data, each preset with its own vocabulary and a context of --block_size
(a checkpoint's size does not depend on it, a step's time does; GPT-2's position table shrinks with it). After
the warm-up it times steps without a save (their median is the step), then takes turns: a synchronous save
(DeepSpeed's TorchCheckpointEngine, then the manifest and `latest`), and a save through BackgroundWriter
followed by steps until training/checkpoints/checkpoint.py's per-step settle completes it. A save's stall is
what the loop lost to it: the synchronous save's whole time; for the background save, the call (the copy into host
memory, also printed alone) plus what the following steps and their settle checks took beyond the step's median.
Prints the medians and the checkpoint's size; writes JSON (--json). The checkpoints go to --work_dir and are
removed at the end.
"""
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from deepspeed.accelerator import get_accelerator

from benchmarks.gpu_figures import preset_vocab
from benchmarks.report import (
    at_least,
    environment,
    load_inputs,
    print_table,
    results_file,
    run_main,
    work_folder,
    write_json,
)
from common.checks import ConfigError, ToolParser
from model import build_model
from training.checkpoints import checkpoint
from training.checkpoints.background_save import BackgroundWriter
from training.engines import train_step, training_engine
from training.launch.failure import join_process_group, leave_process_group
from training.launch.launcher_env import set_single_process_env
from training.optim import optimizer_and_schedule
from training.topology import resolve_layout

PRESETS = ("baby_gpt", "gpt2_124m", "llama_124m")


def measure(preset: str, args, device: torch.device) -> dict:
    overrides = ["data.dir=data/shakespeare_char", "data.tokenizer=char", f"model.block_size={args.block_size}",
                 f"model.vocab_size={preset_vocab(f'configs/{preset}.yaml')}",
                 f"ds.train_micro_batch_size_per_gpu={args.micro_batch}", "ds.gradient_accumulation_steps=1",
                 f"ds.bf16.enabled={args.precision == 'bf16'}", *args.overrides]
    cfg, ds, data = load_inputs(f"configs/{preset}.yaml", args.ds_config, overrides)
    ds.update(optimizer_and_schedule(cfg, ds))
    layout = resolve_layout(ds, 1, 1)
    model = build_model(cfg.model, cfg.train.seed)
    engine = training_engine(model, cfg, ds)
    writers = {"synchronous": engine.checkpoint_engine,
               "background": BackgroundWriter(engine._config)}
    out_dir = os.path.join(args.work_dir, preset)
    shutil.rmtree(out_dir, ignore_errors=True)
    step = 0

    def timed_step() -> float:
        nonlocal step
        step += 1
        batches = data.step_batches(cfg.train.seed, step, 0, layout, device)
        start = time.perf_counter()
        train_step(engine, batches)
        get_accelerator().synchronize()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        timed_step()
    median_step = statistics.median(timed_step() for _ in range(args.steps))
    stalls = {name: [] for name in writers}
    copies, written = [], []
    for _ in range(args.saves):
        for name, writer in writers.items():
            engine.checkpoint_engine = writer
            start = time.perf_counter()
            checkpoint.save(engine, out_dir, step, {"tag": checkpoint.tag_for(step), "step": step}, 1, {})
            stall = time.perf_counter() - start
            if name == "background":
                copies.append(stall)
            while name == "background":
                begun = time.perf_counter()
                done = checkpoint.settle(engine, wait=False)
                stall += time.perf_counter() - begun
                if done:
                    written.append(time.perf_counter() - start)
                    break
                stall += timed_step() - median_step
            stalls[name].append(stall)
            for _ in range(2):  # the next save starts from steady steps
                timed_step()
    tag_dir = checkpoint.find_checkpoint(out_dir)
    size = sum(os.path.getsize(os.path.join(tag_dir, name)) for name in os.listdir(tag_dir))
    shutil.rmtree(out_dir, ignore_errors=True)
    engine.destroy()
    return {"preset": preset, "parameters": sum(p.numel() for p in model.parameters()), "checkpoint_bytes": size,
            "step_s": median_step, "stall_s": {name: statistics.median(values) for name, values in stalls.items()},
            "all_stalls_s": stalls, "background_copy_s": statistics.median(copies),
            "background_written_s": statistics.median(written)}


def main() -> None:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--ds_config", default="ds_configs/zero1.json")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--block_size", type=int, default=128, help="the context of the timed steps")
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="steps timed without a save, for the median step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3, help="saves of each kind, taking turns")
    parser.add_argument("--work_dir", default="out/benchmarks/checkpoint_stall")
    parser.add_argument("--json", default="out/benchmarks/checkpoint_stall.json")
    parser.add_argument("overrides", nargs="*", help="run-config key=value (ds.* for the ds_config)")
    args = parser.parse_args()
    at_least(args, 1, "block_size", "micro_batch", "steps", "saves")
    at_least(args, 0, "warmup")
    for preset in args.presets:
        if not os.path.isfile(f"configs/{preset}.yaml"):
            raise ConfigError(f"--presets {preset}: configs/{preset}.yaml does not exist; fix: name a file of "
                              f"configs/ without .yaml")
    results_file(args.json)
    work_folder(args.work_dir)
    set_single_process_env()
    join_process_group()
    device = torch.device(get_accelerator().device_name(0))
    results = [measure(preset, args, device) for preset in args.presets]
    report = {**environment(device), "ds_config": args.ds_config, "precision": args.precision,
              "block_size": args.block_size, "micro_batch": args.micro_batch, "results": results}
    print(f"\ncheckpoint saves with {args.ds_config}, {args.precision}, on {report['device']} "
          f"(medians of {args.saves} saves each)")
    print_table(["preset", "parameters", "checkpoint", "step", "synchronous save: stall", "background: stall",
                 "background: the copy", "background: written after"],
                [[r["preset"], f"{r['parameters'] / 1e6:.1f}M", f"{r['checkpoint_bytes'] / 2**20:,.0f} MiB",
                  f"{r['step_s'] * 1e3:,.0f} ms", f"{r['stall_s']['synchronous'] * 1e3:,.0f} ms",
                  f"{r['stall_s']['background'] * 1e3:,.0f} ms", f"{r['background_copy_s'] * 1e3:,.0f} ms",
                  f"{r['background_written_s'] * 1e3:,.0f} ms"]
                 for r in results])
    write_json(args.json, report)
    leave_process_group()


if __name__ == "__main__":
    run_main(main)
