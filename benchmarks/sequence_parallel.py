"""Sequence parallelism (Ulysses), measured: sp = 2 against one rank and against dp = 2 at the same tokens per
step, with each rank's activation memory and all-to-all traffic next to the theory.

    python benchmarks/sequence_parallel.py                        # baby Llama, context 4096, fp32, 3 steps
    python benchmarks/sequence_parallel.py --context 1024 --steps 5

Each layout is a real `deepspeed --num_gpus N train.py` run (one thread per rank on CPU, so each rank is one
"device"): one rank, dp 2, sp 2 (ds_configs/sp2.json) and sp 2 with the MLP in 8 tiles (train.mlp_tiles), the
global batch --micro_batch windows in each (dp 2 gives each replica half). Every rank runs train.py under this
file, which counts, without changing what train.py does, the bytes each rank hands to the sequence-parallel
all-to-alls (DeepSpeed's `_SeqAllToAll`) in a step, and the activations one forward pass of a micro-batch keeps
for its backward (torch's saved-tensor hooks, each storage once, the weights left out). Theory:
- activations: training.memory_plan's count (per layer and token, in 16-bit; doubled in fp32) x the layers x
  the tokens a rank holds: micro x context / sp;
- all-to-all (the Ulysses paper's): per layer, micro-batch and rank, q, k, v and the output slices of
  micro x context / sp tokens (query and output n_head x head_dim wide, key and value kv_heads x head_dim) go
  through one all-to-all each, forward and again backward; (sp - 1) / sp of each leaves the rank.
Tokens/s is train.py's own meter over the timed steps (the first step, evaluation and saving excluded).
Prints a table, writes JSON.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import (
    REPO,
    at_least,
    launch_recorded,
    load_inputs,
    print_table,
    results_file,
    run_main,
    run_recorded_rank,
    work_folder,
    write_json,
)
from common.checks import ConfigError, ToolParser

# name: (ranks, ds_config, sequence-parallel degree, MLP tiles)
LAYOUTS = {"one": (1, "zero1.json", 1, 1), "dp2": (2, "zero1.json", 1, 1), "sp2": (2, "sp2.json", 2, 1),
           "sp2_tiled": (2, "sp2.json", 2, 8)}
BABY_LLAMA = ["model.arch=llama", "model.n_kv_head=2", "model.dropout=0", "ds.bf16.enabled=false"]


def counted_rank(record: str) -> None:
    """One rank of train.py, its all-to-all bytes per step and one forward's saved bytes counted."""
    import torch
    from deepspeed.sequence import layer

    from training.observers import Observer

    sent = {"bytes": 0}
    all_to_all = layer.dist.all_to_all_single

    def counting(output, tensor, *args, **kwargs):
        sent["bytes"] += tensor.numel() * tensor.element_size()
        return all_to_all(output, tensor, *args, **kwargs)

    layer.dist.all_to_all_single = counting
    steps = []

    class Measured(Observer):
        def before_step(self, step, driver, micro_batches):
            if not steps:  # one extra forward of the first micro-batch, every rank at once (its all-to-alls)
                before = sent["bytes"]
                self.kept = saved_bytes(driver.engine.module, micro_batches[0][0], torch)
                sent["bytes"] = before
            self.before, self.micro_batches = sent["bytes"], len(micro_batches)

        def after_step(self, step, driver, loss):
            steps.append({"all_to_all_bytes": sent["bytes"] - self.before, "saved": self.kept,
                          "micro_batches": self.micro_batches})

    run_recorded_rank(record, steps, Measured())


def saved_bytes(model, inputs, torch) -> int:
    """Bytes of the activations one forward pass keeps for its backward, each storage once: the weights it
    keeps (the same on every rank, counted with the model states) are left out."""
    kept, weights = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(inputs)
    return sum(kept.values())


def settings(name: str, args) -> list[str]:
    """train.py's key=value for one layout: the same windows a step in every layout, hardly any evaluation, saving
    or sampling."""
    micro = args.micro_batch // 2 if name == "dp2" else args.micro_batch
    return [*BABY_LLAMA, f"train.mlp_tiles={LAYOUTS[name][3]}", "train.resume=none",
            f"model.block_size={args.context}", f"train.max_steps={args.steps}", f"train.log_interval={args.steps}",
            "train.eval_interval=1000000", "train.eval_windows=1", "train.save_interval=0", "sample.max_new_tokens=1",
            "ds.gradient_accumulation_steps=1", f"ds.train_micro_batch_size_per_gpu={micro}", *args.overrides]


def check(args):
    """Every layout's settings, as train.py will read them, before the first run; returns the model settings."""
    at_least(args, 2, "steps")  # the first step is not timed
    at_least(args, 2, "micro_batch")
    at_least(args, 2, "context")
    if args.micro_batch % 2:
        raise ConfigError(f"--micro_batch={args.micro_batch}: must be even (dp2 splits it over its 2 replicas); "
                          f"fix: set --micro_batch to {args.micro_batch + 1}")
    results_file(args.json)
    from model.sequence_parallel import check_sequence_parallel

    for name, (_, ds_config, sp, _) in LAYOUTS.items():
        cfg, _, _ = load_inputs(args.config, f"ds_configs/{ds_config}", settings(name, args), REPO)
        check_sequence_parallel(cfg.model, 1, sp)
    if args.work_dir:
        args.work_dir = work_folder(os.path.join(REPO, args.work_dir))
    return cfg.model


def measure(name: str, args) -> dict:
    ranks, ds_config, _, _ = LAYOUTS[name]
    return launch_recorded(__file__, name, ranks, args.config, ds_config, settings(name, args), args.work_dir)


def theory(cfg, micro_batch: int, sp: int, tiles: int, value_bytes: int) -> dict:
    from training.memory_plan import layer_activation_bytes

    tokens = micro_batch * cfg.block_size // sp
    activations = cfg.n_layer * tokens * layer_activation_bytes(cfg, mlp_tiles=tiles) * value_bytes / 2
    width = 2 * cfg.n_head * cfg.head_width + 2 * cfg.kv_heads * cfg.head_width  # q, output; k, v
    entering = 2 * tokens * width * value_bytes if sp > 1 else 0  # forward and backward, per layer
    return {"activations": activations, "all_to_all_per_layer": entering,
            "leaving_per_layer": entering * (sp - 1) / sp}


def main() -> None:
    parser = ToolParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/baby_gpt.yaml", help="run as a Llama with 2 key/value heads")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro_batch", type=int, default=2, help="windows per step (split over dp2's replicas)")
    parser.add_argument("--work_dir", default=None)
    parser.add_argument("--json", default="out/benchmarks/sequence_parallel.json")
    parser.add_argument("--record", help=argparse.SUPPRESS)  # a rank of one measurement, under the launcher
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", default=[], help="key=value for train.py")
    if "--record" in sys.argv:
        args, _ = parser.parse_known_args(sys.argv[1:sys.argv.index("--")])
        return counted_rank(args.record)
    args = parser.parse_args()
    cfg = check(args)
    cfg.block_size = args.context

    results = {name: measure(name, args) for name in LAYOUTS}
    value_bytes = 2 if any(o == "ds.bf16.enabled=true" for o in args.overrides) else 4
    rows = []
    for name, result in results.items():
        _, _, sp, tiles = LAYOUTS[name]
        micro = args.micro_batch // 2 if name == "dp2" else args.micro_batch
        expected = result["theory"] = theory(cfg, micro, sp, tiles, value_bytes)
        worst = max(result["ranks"], key=lambda r: r["saved"])
        per_layer = worst["all_to_all_bytes"] / (cfg.n_layer * worst["micro_batches"])
        rows.append([name, f"{result['tokens_per_s']:,.0f}", f"{worst['saved'] / 2**20:,.0f}",
                     f"{expected['activations'] / 2**20:,.0f}", f"{per_layer / 2**20:.2f}",
                     f"{expected['all_to_all_per_layer'] / 2**20:.2f}", f"{expected['leaving_per_layer'] / 2**20:.2f}"])
    print(f"\n{args.config} as a Llama, context {args.context}, {args.micro_batch} windows a step, "
          f"{args.steps} steps, one thread per rank")
    print_table(["layout", "tokens/s", "saved for backward MiB/rank", "memory plan MiB", "all-to-all MiB/layer/rank",
                 "Ulysses formula", "of which leaves the rank"], rows)
    one, dp2, sp2 = (results[n] for n in ("one", "dp2", "sp2"))
    for name in ("sp2", "sp2_tiled"):
        ratio = max(r["saved"] for r in results[name]["ranks"]) / one["ranks"][0]["saved"]
        print(f"activations per rank {name} / one: {ratio:.1%} measured, "
              f"{results[name]['theory']['activations'] / one['theory']['activations']:.1%} theory")
    print(f"tokens/s sp2 / dp2: {sp2['tokens_per_s'] / dp2['tokens_per_s']:.2f}x at the same tokens a step "
          f"(sp2 / one: {sp2['tokens_per_s'] / one['tokens_per_s']:.2f}x)")
    write_json(args.json, {"config": args.config, "context": args.context, "steps": args.steps,
                           "micro_batch": args.micro_batch, "overrides": args.overrides, "results": results})


if __name__ == "__main__":
    run_main(main)
