"""Document masking's cost and its effect, on tinyshakespeare's speeches as separate documents.

    python benchmarks/documents.py cost       # baby Llama, context 256 and 1024: tokens/s masked and not, mask memory
    python benchmarks/documents.py quality    # Llama quickstart, masked then unmasked: val loss at equal steps

Both prepare the speeches first (`data.prepare --split_blank_lines`: the blocks of tinyshakespeare between blank
lines, each a document ended by an end-of-text; characters) into --work_dir/speeches, once.
cost: at each context, the baby Llama (configs/baby_gpt.yaml as a Llama: 6 layers, 6 heads, 2 key/value heads,
384 wide, dropout 0) in two DeepSpeed engines as train.py builds them, masked and not, fp32, ZeRO-0, taking
turns on the same batches (benchmarks/turns.py) with --tokens tokens a step. Memory: the bytes of the masks
that one masked forward pass keeps for its backward, seen through torch's saved-tensor hooks, and everything it
keeps beyond the unmasked pass (the masks, and the RoPE tables gathered at each token's position), next to
training.memory_plan's count of that (document_masking_bytes x tokens x layers).
quality: train.py with configs/llama_quickstart.yaml on the speeches, model.document_masking=true, then false,
same seed and batches, one run after the other; each evaluates as it trains (the masked run masked) on the same
validation windows.
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.data import SHAKESPEARE
from benchmarks.report import at_least, load_inputs, print_table, run_main, run_tool, work_folder
from common.checks import ToolParser, existing_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BABY_LLAMA = ["model.arch=llama", "model.n_kv_head=2", "model.dropout=0", "ds.bf16.enabled=false"]
CONFIGS = {"cost": ("configs/baby_gpt.yaml", "ds_configs/zero0.json"),
           "quality": ("configs/llama_quickstart.yaml", "ds_configs/zero0.json")}


def check_settings(args) -> None:
    """The runs' settings, checked before anything is prepared (the data is checked where it is opened)."""
    from training.config import load_run_config, split_overrides
    from training.ds_config import load_ds_config

    config, ds_config = CONFIGS[args.what]
    run_overrides, ds_overrides = split_overrides([*(BABY_LLAMA if args.what == "cost" else []), *args.overrides])
    load_run_config(os.path.join(REPO, config), run_overrides)
    load_ds_config(os.path.join(REPO, ds_config), ds_overrides)


def prepare_speeches(text: str, work_dir: str) -> str:
    """tinyshakespeare's speeches as a prepared dataset of separate documents (made once per work folder)."""
    out = os.path.join(work_dir, "speeches")
    if not os.path.exists(os.path.join(out, "meta.json")):
        run_tool([sys.executable, "-m", "data.prepare", "--tokenizer", "char", "--split_blank_lines", "--input", text,
                  "--out_dir", out], cwd=REPO)
    return out


def saved_bytes(model, inputs) -> tuple[int, int]:
    """(bytes of the attention masks, bytes of every tensor) that one forward pass keeps for its backward. A mask
    is a (batch, 1, T, T) tensor of 0 and -inf (scaled_dot_product_attention's conversion of the boolean one)."""
    import torch

    masks, every = {}, {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        every[storage.data_ptr()] = storage.nbytes()
        T = tensor.size(-1) if tensor.dim() == 4 else 0
        if T and tensor.size(1) == 1 and tensor.size(2) == T and ((tensor == 0) | (tensor == -math.inf)).all():
            masks[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(inputs)
    return sum(masks.values()), sum(every.values())


def cost(args, data_dir: str) -> dict:
    import torch
    from deepspeed.accelerator import get_accelerator

    from benchmarks.turns import timed_turns
    from model import build_model
    from training.engines import train_step, training_engine
    from training.launch.failure import join_process_group, leave_process_group
    from training.launch.launcher_env import set_single_process_env
    from training.memory_plan import document_masking_bytes
    from training.optim import optimizer_and_schedule
    from training.topology import resolve_layout

    set_single_process_env()
    join_process_group()
    device = torch.device(get_accelerator().device_name(0))
    results = {}
    for context in args.contexts:
        micro = max(1, args.tokens // context)
        runners, inputs = {}, {}
        for masking in (True, False):
            settings = [*BABY_LLAMA, f"data.dir={data_dir}", f"model.block_size={context}",
                        f"model.document_masking={masking}", f"ds.train_micro_batch_size_per_gpu={micro}"]
            cfg, ds, data = load_inputs(*CONFIGS["cost"], [*settings, *args.overrides], REPO)
            ds.update(optimizer_and_schedule(cfg, ds))
            model = build_model(cfg.model, cfg.train.seed)
            engine = training_engine(model, cfg, ds)
            layout = resolve_layout(ds, 1, 1)
            runners[masking] = (lambda step, e=engine, d=data, c=cfg, lay=layout:
                                train_step(e, d.step_batches(c.train.seed, step, 0, lay, device)))
            inputs[masking] = (engine, data.train_batch(cfg.train.seed, 1, 0, 0, layout, device)[0], cfg)
        seconds = timed_turns(runners, args.warmup, args.steps, args.chunk)
        (engine, batch, cfg), (plain_engine, plain_batch, _) = inputs[True], inputs[False]
        masks, masked_total = saved_bytes(engine.module, batch)
        planned = document_masking_bytes(cfg.model, device.type, torch.finfo(torch.float32).bits // 8) * \
            batch[0].numel() * cfg.model.n_layer
        tokens = micro * context * args.steps
        results[context] = {"micro_batch": micro, "masked_tokens_per_s": tokens / seconds[True],
                            "unmasked_tokens_per_s": tokens / seconds[False], "mask_bytes_measured": masks,
                            "added_bytes_planned": planned,
                            "saved_bytes_added": masked_total - saved_bytes(plain_engine.module, plain_batch)[1],
                            "documents_per_window": float((batch[1] == 0).sum()) / batch[1].size(0)}
    print_table(["context", "micro batch", "documents/window", "tokens/s masked", "tokens/s unmasked", "ratio",
                 "masks kept", "all kept, masked - unmasked", "memory plan's count of it"],
                [[c, r["micro_batch"], f"{r['documents_per_window']:.1f}", f"{r['masked_tokens_per_s']:,.0f}",
                  f"{r['unmasked_tokens_per_s']:,.0f}", f"{r['masked_tokens_per_s'] / r['unmasked_tokens_per_s']:.3f}",
                  f"{r['mask_bytes_measured'] / 2**20:.1f} MiB", f"{r['saved_bytes_added'] / 2**20:.1f} MiB",
                  f"{r['added_bytes_planned'] / 2**20:.1f} MiB"]
                 for c, r in results.items()])
    leave_process_group()
    return results


def quality(args, data_dir: str) -> dict:
    results = {}
    for masking in ("true", "false"):
        out_dir = os.path.join(args.work_dir, f"quality_{'masked' if masking == 'true' else 'unmasked'}")
        cmd = [sys.executable, "train.py", "--config", CONFIGS["quality"][0], f"data.dir={data_dir}",
               f"train.out_dir={out_dir}", "train.resume=none", f"model.document_masking={masking}", *args.overrides]
        print(" ".join(cmd), flush=True)
        start = time.perf_counter()
        run_tool(cmd, cwd=REPO, stdout=open(os.path.join(args.work_dir, f"quality_{masking}.log"), "w"))
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        results[masking] = {"val_loss": {r["step"]: r["val_loss"] for r in records if "val_loss" in r},
                            "wall_s": time.perf_counter() - start}
    masked, unmasked = results["true"], results["false"]
    print_table(["step", "val loss masked", "val loss unmasked", "difference"],
                [[step, f"{loss:.4f}", f"{unmasked['val_loss'][step]:.4f}", f"{loss - unmasked['val_loss'][step]:+.4f}"]
                 for step, loss in masked["val_loss"].items()])
    print(f"wall time: {masked['wall_s']:.0f} s masked, {unmasked['wall_s']:.0f} s unmasked")
    return {"masked": masked, "unmasked": unmasked}


def main() -> None:
    parser = ToolParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["cost", "quality"])
    parser.add_argument("--text", default=SHAKESPEARE, help="tinyshakespeare's text (default: $SHAKESPEARE_TXT, "
                        "else the shared copy beside the repo)")
    parser.add_argument("--work_dir", default=os.path.join("out", "documents"),
                        help="the speeches' dataset, the runs and the results go here")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024], help="cost: contexts to time")
    parser.add_argument("--tokens", type=int, default=4096, help="cost: tokens a step (micro batch x context)")
    parser.add_argument("--steps", type=int, default=20, help="cost: timed steps per engine, after warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="run-config key=value for every run")
    args = parser.parse_intermixed_args()
    at_least(args, 1, "steps", "chunk", "tokens", "contexts")
    at_least(args, 0, "warmup")
    existing_file(args.text, "--text", "point --text at tinyshakespeare.txt")
    check_settings(args)
    args.work_dir = work_folder(os.path.join(REPO, args.work_dir))
    data_dir = prepare_speeches(args.text, args.work_dir)
    results = cost(args, data_dir) if args.what == "cost" else quality(args, data_dir)
    with open(os.path.join(args.work_dir, f"{args.what}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    run_main(main)
