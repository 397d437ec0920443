"""The Llama beside the GPT, in one run: quality at the quickstart size, throughput and MFU at the baby size.

    python benchmarks/llama.py quality        # both quickstart models at the Llama's recipe: val loss side by side
    python benchmarks/llama.py throughput     # baby GPT and baby Llama engines in one process, bf16, ZeRO-0

quality runs `train.py` with configs/quickstart.yaml and configs/llama_quickstart.yaml (817,920 and 820,352
parameters) one after the other, both at the Llama preset's learning rates and steps (the GPT's own recipe is a
shorter one: configs/quickstart.yaml), and prints their final val losses.
throughput builds both models in DeepSpeed engines (as train.py does) in one process and lets them take
turns every --chunk steps on the same batches after --warmup untimed steps each, so a slow spell of the
machine hits both; MFU is model FLOP/s (training.metrics.flops_per_token, which counts grouped-query
attention and the SwiGLU MLP) over train.py's peak for the device (training/device.py). The baby Llama: 6 layers,
6 heads, 2 key/value heads, 384 wide, SwiGLU 1024 (Llama's rule), context 256.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import at_least, load_inputs, print_table, run_main, run_tool
from common.checks import ToolParser, new_output

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTARTS = {"gpt": "configs/quickstart.yaml", "llama": "configs/llama_quickstart.yaml"}
BABY_LLAMA = ["model.arch=llama", "model.n_kv_head=2"]
THROUGHPUT = {"gpt": ["model.dropout=0", "ds.bf16.enabled=true"], "llama": ["model.dropout=0", "ds.bf16.enabled=true",
                                                                            *BABY_LLAMA]}


def check(args) -> dict:
    """Everything the runs will read, checked before the first one starts: {model: (cfg, ds, data)}."""
    at_least(args, 1, "steps", "chunk")
    at_least(args, 0, "warmup")
    new_output(os.path.join(REPO, args.out_dir), "--out_dir", "give a new or empty folder: each run starts afresh")
    if args.what == "quality":
        from training.config import DEFAULT_DS_CONFIG  # train.py's, which the quality runs use

        return {arch: load_inputs(config, DEFAULT_DS_CONFIG, args.overrides, REPO)
                for arch, config in QUICKSTARTS.items()}
    return {arch: load_inputs("configs/baby_gpt.yaml", "ds_configs/zero0.json", [*extra, *args.overrides], REPO)
            for arch, extra in THROUGHPUT.items()}


def quality(args, inputs: dict) -> dict:
    llama = inputs["llama"][0]
    recipe = [f"optim.lr={llama.optim.lr}", f"optim.min_lr={llama.optim.min_lr}",
              f"optim.warmup_steps={llama.optim.warmup_steps}", f"train.max_steps={llama.train.max_steps}"]
    results = {}
    for arch, config in QUICKSTARTS.items():
        out_dir = os.path.join(args.out_dir, arch)
        cmd = [sys.executable, "train.py", "--config", config, f"train.out_dir={out_dir}", "train.resume=none",
               *recipe, *args.overrides]
        print(" ".join(cmd), flush=True)
        start = time.perf_counter()
        run_tool(cmd, cwd=REPO, stdout=subprocess.DEVNULL)
        with open(os.path.join(REPO, out_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        val = [r for r in records if "val_loss" in r][-1]
        results[arch] = {"step": val["step"], "val_loss": val["val_loss"], "wall_s": time.perf_counter() - start}
    print_table(["model", "preset", "step", "val loss", "wall time"],
                [[arch, QUICKSTARTS[arch], r["step"], f"{r['val_loss']:.4f}", f"{r['wall_s']:.0f} s"]
                 for arch, r in results.items()])
    return results


def throughput(args, inputs: dict) -> dict:
    import torch
    from deepspeed.accelerator import get_accelerator

    from benchmarks.turns import timed_turns
    from model import build_model
    from training.device import peak_flops
    from training.engines import train_step, training_engine
    from training.launch.failure import join_process_group, leave_process_group
    from training.launch.launcher_env import set_single_process_env
    from training.metrics import flops_per_token
    from training.optim import optimizer_and_schedule
    from training.topology import resolve_layout

    set_single_process_env()
    join_process_group()
    device = torch.device(get_accelerator().device_name(0))
    runners = {}
    for arch, (cfg, ds, data) in inputs.items():
        ds.update(optimizer_and_schedule(cfg, ds))
        model = build_model(cfg.model, cfg.train.seed)
        engine = training_engine(model, cfg, ds)
        runners[arch] = (cfg, engine, data, resolve_layout(ds, 1, 1), sum(p.numel() for p in model.parameters()))

    def runner(cfg, engine, data, layout, _):
        return lambda step: train_step(engine, data.step_batches(cfg.train.seed, step, 0, layout, device))

    seconds = timed_turns({arch: runner(*r) for arch, r in runners.items()}, args.warmup, args.steps, args.chunk)
    peak, peak_source = peak_flops(device, torch.bfloat16)
    results = {}
    for arch, (cfg, engine, data, layout, params) in runners.items():
        tokens_per_s = layout.global_batch * cfg.model.block_size * args.steps / seconds[arch]
        results[arch] = {"parameters": params, "tokens_per_s": tokens_per_s,
                         "mfu": tokens_per_s * flops_per_token(cfg.model) / peak,
                         "flops_per_token": flops_per_token(cfg.model)}
    print_table(["model", "parameters", "FLOPs/token", "tokens/s", "MFU"],
                [[arch, f"{r['parameters']:,}", f"{r['flops_per_token']:,}", f"{r['tokens_per_s']:,.0f}",
                  f"{100 * r['mfu']:.1f}%"] for arch, r in results.items()])
    ratio = results["llama"]["mfu"] / results["gpt"]["mfu"]
    print(f"Llama MFU / GPT MFU: {ratio:.3f} (MFU against {peak / 1e12:.3f} TFLOP/s: {peak_source})")
    leave_process_group()
    return {**results, "mfu_ratio": ratio, "peak_tflops": peak / 1e12}


def main() -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["quality", "throughput"])
    parser.add_argument("--steps", type=int, default=20, help="throughput: timed steps per model, after warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=5)
    parser.add_argument("--out_dir", default=os.path.join("out", "llama_vs_gpt", time.strftime("%Y%m%d-%H%M%S")))
    parser.add_argument("overrides", nargs="*", help="run-config key=value for both models")
    args = parser.parse_intermixed_args()  # key=value overrides after --options too
    inputs = check(args)
    results = quality(args, inputs) if args.what == "quality" else throughput(args, inputs)
    os.makedirs(os.path.join(REPO, args.out_dir), exist_ok=True)
    with open(os.path.join(REPO, args.out_dir, f"{args.what}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    run_main(main)
