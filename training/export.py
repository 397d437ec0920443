"""Export a checkpoint as one safetensors file of full fp32 weights plus a config.json.

    python -m training.export --out_dir out/gpt2_124m [--tag step_005000] [--output DIR]

Any checkpoint works: ZeRO 0-3, pipelined or not, or already universal. GPT and Llama weights are written
in Hugging Face's layout (training/hf.py), so `GPT2LMHeadModel` / `LlamaForCausalLM.from_pretrained(DIR)`
load them; encoder weights keep this repo's names. config.json also carries this repo's model settings
and the tokenizer, for `sample.py --export DIR`.
"""
import argparse
import dataclasses
import glob
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from model import build_model
from model.config import ModelConfig
from model.parallel import TensorParallel, merge_parameter, split_rule
from training import checkpoint
from training.checks import ConfigError, exit_bad_input
from training.hf import ARCHITECTURES, from_hf, hf_config, to_hf
from training.optim import decay_split


def model_config(run_state: dict) -> ModelConfig:
    return ModelConfig(**run_state["config"]["model"])


def consolidated_state_dict(tag_dir: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights (this repo's parameter names) from a complete checkpoint, on the CPU."""
    run_state = checkpoint.read_run_state(tag_dir)
    tp = run_state["layout"].get("tp", 1)
    with torch.device("meta"):
        model = build_model(model_config(run_state))
        sliced = build_model(model_config(run_state), tp=TensorParallel(tp)) if tp > 1 else model  # a rank's view
    shapes = {name: p.shape for name, p in model.named_parameters()}
    if run_state.get("universal"):
        return _from_universal(tag_dir, shapes)
    if glob.glob(os.path.join(tag_dir, "*optim_states.pt")):  # ZeRO 1-3, or any bf16 pipeline
        scratch = f"{tag_dir}_export_tmp"
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            checkpoint.convert(tag_dir, scratch)
            return _from_universal(scratch, shapes)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if run_state["layout"]["pp"] > 1:  # fp32 pipeline without ZeRO: the layer files hold fp32 weights
        slices = [{} for _ in range(tp)]  # per tensor rank: layer_<index>-model_<tensor rank>-model_states.pt
        for path in sorted(glob.glob(os.path.join(tag_dir, "layer_*-model_states.pt"))):
            index, rank = (int(part.split("_")[1]) for part in os.path.basename(path).split("-")[:2])
            for name, tensor in checkpoint.load_state_file(path).items():
                key = f"{index}.{name}" if f"{index}.{name}" in shapes else f"tied_modules.embed.{name}"
                slices[rank].setdefault(key, tensor.float())
    else:  # ZeRO-0: one file per tensor rank with the module (fp32, or bf16 beside the optimizer's fp32 masters)
        slices = [_module_state(os.path.join(tag_dir, f"mp_rank_{rank:02d}_model_states.pt"), sliced)
                  for rank in range(tp)]
    rules = {name: split_rule(p) for name, p in sliced.named_parameters()}
    return {name: merge_parameter([s[name] for s in slices], rules[name]) for name in slices[0]}


def _module_state(path: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    saved = checkpoint.load_state_file(path)
    masters = saved["optimizer"].get("fp32_groups") if isinstance(saved["optimizer"], dict) else None
    if masters is None:
        return {name: tensor.float() for name, tensor in saved["module"].items()}
    decay, no_decay = decay_split(model.named_parameters())  # the order train.py gave the optimizer
    names = [n for n, _ in decay] + [n for n, _ in no_decay]
    return dict(zip(names, [t.float() for group in masters for t in group]))


def _from_universal(folder: str, shapes: dict) -> dict[str, torch.Tensor]:
    state = {}
    for name, shape in shapes.items():
        saved = checkpoint.load_state_file(os.path.join(folder, "zero", name, "fp32.pt"))
        state[name] = (saved["param"] if isinstance(saved, dict) else saved).reshape(shape).float()
    return state


def tokenizer_dir(run_state: dict) -> str:
    """The prepared dataset whose meta.json and tokenizer files a checkpoint's run used: the first source of a
    blend (every source shares one tokenizer), else data.dir."""
    data = run_state["config"]["data"]
    return data["sources"][0]["dir"] if data.get("sources") else data["dir"]


def export(tag_dir: str, output: str) -> str:
    run_state = checkpoint.read_run_state(tag_dir)
    data_dir = tokenizer_dir(run_state)
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    return write_export(output, model_config(run_state), consolidated_state_dict(tag_dir), meta, run_state["step"],
                        data_dir)


# A tokenizer a dataset keeps beside its data in a Hugging Face or tiktoken file goes with the weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.tiktoken")


def write_export(output: str, cfg: ModelConfig, state: dict, meta: dict, step: int, data_dir: str | None = None) -> str:
    """model.safetensors (Hugging Face's layout where it has one) and config.json in `output`."""
    in_hf_layout = cfg.arch in ARCHITECTURES
    config = hf_config(cfg, meta) if in_hf_layout else {}
    config["megalite"] = {"model": dataclasses.asdict(cfg), "tokenizer": meta, "step": step}
    os.makedirs(output, exist_ok=True)
    weights = to_hf(state, cfg) if in_hf_layout else state
    save_file(weights, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for name in TOKENIZER_FILES:
        if data_dir and os.path.isfile(os.path.join(data_dir, name)):
            shutil.copyfile(os.path.join(data_dir, name), os.path.join(output, name))
    return output


def load_export(folder: str) -> tuple[ModelConfig, dict, dict]:
    """(model config, state dict with this repo's names, tokenizer meta) of an export."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    cfg = ModelConfig(**config["megalite"]["model"])
    weights = load_file(os.path.join(folder, "model.safetensors"))
    return cfg, from_hf(weights, cfg) if cfg.arch in ARCHITECTURES else weights, config["megalite"]["tokenizer"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", required=True, help="the run's train.out_dir")
    parser.add_argument("--tag", help="default: the newest complete checkpoint")
    parser.add_argument("--output", help="default: <out_dir>/export/<tag>")
    args = parser.parse_args(argv)
    try:
        tag_dir = checkpoint.find_resume(args.out_dir, args.tag or "auto")
        if tag_dir is None:
            raise ConfigError(f"no complete checkpoint in {checkpoint.checkpoint_root(args.out_dir)}")
        output = args.output or os.path.join(args.out_dir, "export", os.path.basename(tag_dir))
        print(f"wrote {export(tag_dir, output)}: model.safetensors, config.json")
    except ConfigError as e:
        exit_bad_input(e)


if __name__ == "__main__":
    main()
