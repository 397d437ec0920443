"""A LoRA run's adapters in PEFT's layout (`python -m scripts.export --adapter`): adapter_config.json and
adapter_model.safetensors, which `peft.PeftModel.from_pretrained` puts on the Hugging Face model the run started
from (its train.init_from, recorded as base_model_name_or_path). The adapters alone: megabytes, where the merged
export (export.py) is the whole model. `peft` itself is never imported here (the tests load what this writes with
it).

Each adapted map is named by its Hugging Face module (training/checkpoints/hf.py's pairs): A (r x in) as its
lora_A.weight, B (out x r) as its lora_B.weight. target_modules lists the modules by their whole names, so a
GPT-2 whose attention's c_proj is adapted and whose MLP's c_proj is not is read as it was trained; GPT-2's Conv1D
maps, which store their weights transposed, are marked fan_in_fan_out.
"""
import json
import os

from safetensors.torch import save_file

from common.checks import ConfigError, new_output
from model.architecture import TRANSPOSED
from model.config import ModelConfig
from training.checkpoints import checkpoint
from training.checkpoints.export import consolidated_state_dict, run_model, write_whole
from training.checkpoints.hf import tensor_pairs

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_adapter(cfg: ModelConfig, state: dict, base: str | None) -> tuple[dict, dict]:
    """(adapter_config.json's settings, adapter_model.safetensors' tensors) of a LoRA model's state dict."""
    if not cfg.lora_rank:
        raise ConfigError("the checkpoint holds no adapters (its model.lora_rank is 0); fix: export it without "
                          "--adapter, as the whole model")
    if not cfg.generates:
        raise ConfigError("the checkpoint is a reward model's (model.head=score), whose score head trains beside the "
                          "adapters; fix: export it without --adapter (the adapters merged, the head with them)")
    pairs = {ours: (theirs, how) for ours, theirs, how in tensor_pairs(cfg)}
    tensors, modules, transposed = {}, [], False
    for name in sorted(state):
        if not name.endswith(".lora_a"):
            continue
        prefix = name.removesuffix("lora_a")
        theirs, how = pairs[f"{prefix}weight"]
        module = theirs.removesuffix(".weight")
        modules.append(module)
        transposed |= how == TRANSPOSED
        tensors[f"base_model.model.{module}.lora_A.weight"] = state[name].contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = state[f"{prefix}lora_b"].contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha,
              "lora_dropout": cfg.lora_dropout, "bias": "none", "target_modules": modules, "fan_in_fan_out": transposed,
              "base_model_name_or_path": base, "inference_mode": True}
    return config, tensors


def export_adapter(tag_dir: str, output: str, force: bool = False) -> str:
    """The adapters of the checkpoint at tag_dir, for the model its run started from."""
    run_state = checkpoint.read_run_state(tag_dir)
    base = run_state["config"]["train"].get("init_from")
    return write_adapter(output, run_model(tag_dir, run_state), consolidated_state_dict(tag_dir),
                         os.path.abspath(base) if base else None, force)


def write_adapter(output: str, cfg: ModelConfig, state: dict, base: str | None, force: bool = False) -> str:
    """The adapters in `output`, whole or not at all: a new folder, or with `force` an earlier adapter export."""
    config, tensors = peft_adapter(cfg, state, base)
    if not (force and os.path.isfile(os.path.join(output, ADAPTER_CONFIG))):
        new_output(output, "--output", "pass another --output (--force replaces only an earlier adapter export)")

    def write(folder: str) -> None:
        save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=1)
    write_whole(output, write)
    print(f"wrote {output}: {', '.join(sorted(os.listdir(output)))} ({len(config['target_modules'])} adapted maps of "
          f"rank {cfg.lora_rank}" + (f", for {base}" if base else "") + ")")
    return output
