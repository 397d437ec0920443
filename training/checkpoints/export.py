"""A checkpoint of any layout as one safetensors file of full fp32 weights plus a config.json, in Hugging Face's
layout where the architecture has one (training/checkpoints/hf.py), written whole or not at all; and an export, or a
checkpoint's merged weights, read back into a model (load_trained). The command: scripts/export.py.
"""
import dataclasses
import glob
import hashlib
import json
import os
import shutil
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from common.checks import ConfigError, existing_dir, existing_file, json_file, new_output
from data.meta import check_meta, read_meta
from data.tokenizers import tokenizer_from_meta
from model import architecture, build_empty, build_model, layer_names, model_layers
from model.config import ModelConfig, model_config
from model.lora import merged
from model.tensor_parallel import TensorParallel, merge_parameter, split_rule
from training.checkpoints import checkpoint, universal
from training.checkpoints.hf import from_hf, hf_config, to_hf
from training.checkpoints.hf_folder import is_hf_folder, load_hf_folder
from training.optim import decay_split


def run_model(tag_dir: str, run_state: dict) -> ModelConfig:
    return model_config(run_state["config"]["model"], f"checkpoint run state {tag_dir}/{checkpoint.RUN_STATE}")


def consolidated_state_dict(tag_dir: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights (this repo's parameter names) from a complete checkpoint, on the CPU."""
    run_state = checkpoint.read_run_state(tag_dir)
    tp_size = run_state["layout"]["tp"]
    cfg = run_model(tag_dir, run_state)
    with torch.device("meta"):
        model = build_model(cfg)
        sliced = build_model(cfg, tp=TensorParallel(tp_size)) if tp_size > 1 else model  # a rank's view
    rules = {name: split_rule(p) for name, p in sliced.named_parameters()}
    if cfg.n_experts:
        return _with_experts(tag_dir, tp_size, rules)
    if run_state.get("universal"):  # LoRA's frozen weights among its module entries (universal.write_entries)
        return _from_universal(tag_dir, {name: p.shape for name, p in model.named_parameters()})
    # What the optimizer holds: every weight, or under LoRA the adapters alone (the frozen weights come apart)
    shapes = {name: p.shape for name, p in model.named_parameters() if p.requires_grad}
    frozen = _frozen_weights(tag_dir, run_state, cfg, [n for n, p in model.named_parameters() if not p.requires_grad],
                             rules)
    if glob.glob(os.path.join(tag_dir, "*optim_states.pt")):  # ZeRO 1-3, or any bf16 pipeline
        scratch = f"{tag_dir}_export_tmp"
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            universal.convert(tag_dir, scratch)
            return {**_from_universal(scratch, shapes), **frozen}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if run_state["layout"]["pp"] > 1:  # fp32 pipeline without ZeRO: the layer files hold fp32 weights
        slices = _layer_files(tag_dir, cfg, tp_size)
    else:  # ZeRO-0: one file per tensor rank with the module (fp32, or bf16 beside the optimizer's fp32 masters)
        slices = [_module_state(os.path.join(tag_dir, f"mp_rank_{rank:02d}_model_states.pt"), sliced)
                  for rank in range(tp_size)]
    return {**{name: merge_parameter([s[name] for s in slices], rules[name]) for name in slices[0]}, **frozen}


def _layer_files(tag_dir: str, cfg: ModelConfig, tp_size: int) -> list[dict[str, torch.Tensor]]:
    """A pipeline's module as its layer files hold it (in the dtype it computed in), per tensor rank."""
    prefixes = layer_names(model_layers(cfg))
    slices = [{} for _ in range(tp_size)]  # per tensor rank: layer_<index>-model_<tensor rank>-model_states.pt
    for path in sorted(glob.glob(os.path.join(tag_dir, "layer_*-model_states.pt"))):
        index, rank = (int(part.split("_")[1]) for part in os.path.basename(path).split("-")[:2])
        for name, tensor in checkpoint.load_state_file(path).items():
            slices[rank].setdefault(f"{prefixes[index]}.{name}", tensor.float())
    return slices


def frozen_weights(tag_dir: str) -> dict[str, torch.Tensor]:
    """A LoRA run's frozen weights, whole (fp32, this repo's names), which the universal converter must write
    itself; none without LoRA."""
    run_state = checkpoint.read_run_state(tag_dir)
    cfg, tp_size = run_model(tag_dir, run_state), run_state["layout"]["tp"]
    with torch.device("meta"):
        names = [name for name, p in build_model(cfg).named_parameters() if not p.requires_grad]
        rules = {name: split_rule(p) for name, p in build_model(cfg, tp=TensorParallel(tp_size)).named_parameters()}
    return _frozen_weights(tag_dir, run_state, cfg, names, rules)


def _frozen_weights(tag_dir: str, run_state: dict, cfg: ModelConfig, names: list[str],
                    rules: dict) -> dict[str, torch.Tensor]:
    """LoRA's frozen weights (`names`), which no optimizer holds and DeepSpeed's universal converter, reading the
    optimizer's files, leaves out: the module's own copies, each tensor rank's slice merged by `rules`. A pipeline's
    layer files; under ZeRO-3 each rank's fragment of each (DeepSpeed's frozen_param_fragments, in data-parallel
    rank order); else the module's file."""
    if not names:
        return {}
    layout = run_state["layout"]
    if layout["pp"] > 1:
        slices = _layer_files(tag_dir, cfg, layout["tp"])
    elif layout.get("zero_stage") == 3:
        slices = [_zero3_frozen(tag_dir, rank) for rank in range(layout["tp"])]
    else:
        slices = [checkpoint.load_state_file(os.path.join(tag_dir, f"mp_rank_{rank:02d}_model_states.pt"))["module"]
                  for rank in range(layout["tp"])]
    return {name: merge_parameter([s[name].float() for s in slices], rules[name]) for name in names}


def _zero3_frozen(tag_dir: str, tensor_rank: int) -> dict[str, torch.Tensor]:
    """A tensor rank's frozen weights under ZeRO-3, from its data-parallel ranks' fragments."""
    paths = glob.glob(os.path.join(tag_dir, f"zero_pp_rank_*_mp_rank_{tensor_rank:02d}_model_states.pt"))
    ranks = [checkpoint.load_state_file(path) for path in
             sorted(paths, key=lambda path: int(os.path.basename(path).split("_")[3]))]
    return {name: torch.cat([r["frozen_param_fragments"][name].flatten() for r in ranks])[: shape.numel()].view(shape)
            for name, shape in ranks[0]["frozen_param_shapes"].items()}


def _with_experts(tag_dir: str, tp_size: int, rules: dict) -> dict[str, torch.Tensor]:
    """A mixture of experts' weights: the module's files without the experts (one per pipeline stage, or per
    tensor rank: their slices merged by `rules`), and DeepSpeed's file of each expert (its tensors named with the
    expert's global index, as a one-rank model names them). These are the weights the model computes with (bf16
    copies under bf16): DeepSpeed's universal converter, which gathers the fp32 masters of every other layout,
    does not read native MoE checkpoints."""
    modules = [{name: tensor.float() for name, tensor in checkpoint.load_state_file(path)["module"].items()}
               for path in sorted(glob.glob(os.path.join(tag_dir, "mp_rank_*_model_states.pt")))]
    if tp_size > 1:
        state = {name: merge_parameter([m[name] for m in modules], rules[name]) for name in modules[0]}
    else:
        state = {name: tensor for module in modules for name, tensor in module.items()}
    for path in sorted(glob.glob(os.path.join(tag_dir, "layer_*_expert_*_model_states.pt"))):
        state.update({name: tensor.float() for name, tensor in checkpoint.load_state_file(path).items()})
    return state


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


def run_dataset(tag_dir: str, run_state: dict) -> tuple[dict, str]:
    """The checked meta.json, and the folder, of the dataset whose tokenizer a checkpoint's run used."""
    data = run_state["config"].get("data")
    if not isinstance(data, dict) or not (data.get("sources") or data.get("dir")):
        raise ConfigError(f"checkpoint run state {tag_dir}/{checkpoint.RUN_STATE} names no dataset (config.data.dir): "
                          f"it was written by another version of this repo; fix: export it with that version")
    data_dir = tokenizer_dir(run_state)
    fix = (f"run this from the folder the run was started in, or prepare its dataset again at {data_dir} "
           f"(python -m data.prepare ... --out_dir {data_dir})")
    return read_meta(data_dir, "the run's dataset (data.dir)", fix), data_dir


def export(tag_dir: str, output: str, force: bool = False) -> str:
    """The checkpoint at tag_dir as an export in `output`: a new folder, the export of the same checkpoint (left as
    it is), or, with `force`, an earlier export (replaced)."""
    run_state = checkpoint.read_run_state(tag_dir)
    source = {"tag": os.path.basename(tag_dir), "sha256": _fingerprint(tag_dir)}
    earlier = _export_record(output)
    if earlier is not None and earlier.get("source") == source:
        print(f"{output} already holds the export of {tag_dir}; nothing to do")
        return output
    if not (force and earlier is not None):  # --force replaces an export, never any other folder
        new_output(output, "--output", "pass --force to replace that export, or another --output" if earlier is not None
                   else "pass another --output (--force replaces only an earlier export)")
    meta, data_dir = run_dataset(tag_dir, run_state)
    write_export(output, run_model(tag_dir, run_state), consolidated_state_dict(tag_dir), meta, run_state["step"],
                 data_dir, source)
    print(f"wrote {output}: {', '.join(sorted(os.listdir(output)))}")
    return output


def _fingerprint(tag_dir: str) -> str:
    """A checkpoint's identity, wherever its run folder is moved or copied: the digest of its run state (run
    config, step, data) and its manifest (every file and its size)."""
    digest = hashlib.sha256()
    for name in (checkpoint.RUN_STATE, checkpoint.MANIFEST):
        with open(os.path.join(tag_dir, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def _export_record(folder: str) -> dict | None:
    """The "megalite" section of the config.json of an export in `folder`; None where there is none."""
    try:
        with open(os.path.join(folder, "config.json"), "rb") as f:
            record = json.loads(f.read()).get("megalite")
    except (OSError, ValueError, AttributeError):
        return None
    return record if isinstance(record, dict) else None


# A tokenizer a dataset keeps beside its data in a Hugging Face or tiktoken file goes with the weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.tiktoken")


def write_export(output: str, cfg: ModelConfig, state: dict, meta: dict, step: int, data_dir: str | None = None,
                 source: dict | None = None) -> str:
    """model.safetensors (Hugging Face's layout where it has one) and config.json in `output`, whole or not at
    all; `source`: the checkpoint they come from, recorded in config.json. LoRA's adapters are merged into the
    weights they adapt: the export is the adapted model, without adapters."""
    cfg, state = merged(cfg, state)
    in_hf_layout = architecture(cfg).hf_layout(cfg) is not None
    config = hf_config(cfg, meta) if in_hf_layout else {}
    config["megalite"] = {"model": dataclasses.asdict(cfg), "tokenizer": meta, "step": step,
                          **({"source": source} if source else {})}

    def write(folder: str) -> None:
        weights = to_hf(state, cfg) if in_hf_layout else state
        save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        for file in TOKENIZER_FILES:
            if data_dir and os.path.isfile(os.path.join(data_dir, file)):
                shutil.copyfile(os.path.join(data_dir, file), os.path.join(folder, file))
        if "chat" in meta:  # the template the model was fine-tuned with, for apply_chat_template
            with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
                json.dump(chat_tokenizer_config(meta), f, indent=1)
    return write_whole(output, write)


def write_whole(output: str, write: Callable[[str], None]) -> str:
    """`write(folder)` into a scratch folder beside `output`, then renamed into place: `output` holds all of it or,
    where writing failed, what it held before."""
    parent, name = os.path.split(os.path.abspath(output))
    scratch = os.path.join(parent, f".{name}.tmp{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    try:
        write(scratch)
        _replace_folder(scratch, output)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return output


def chat_tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json of a model fine-tuned on conversations: its chat template with the special tokens it
    was rendered with (so apply_chat_template renders as training did), else the end-of-turn token as eos_token
    (config.json's eos_token_id, where generation stops, is the end of turn either way)."""
    chat = meta["chat"]
    return {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat["chat_template"],
            "eos_token": chat["end_of_turn"], **(chat.get("special_tokens") or {}),
            "clean_up_tokenization_spaces": False}


def _replace_folder(new: str, old: str) -> None:
    """Folder `new` renamed to `old`; an earlier `old` with files in it is moved aside first and removed after,
    so `old` is never half of one export and half of another."""
    aside = f"{new}.old" if os.path.isdir(old) and os.listdir(old) else None
    if aside:
        os.rename(old, aside)
    os.replace(new, old)  # onto nothing, or onto an empty folder
    if aside:
        shutil.rmtree(aside)


def load_export(folder: str) -> tuple[ModelConfig, dict, dict]:
    """(model config, state dict with this repo's names, tokenizer meta) of an export."""
    fix = "pass a folder written by python -m scripts.export, or export the checkpoint again"
    existing_dir(folder, "--export", fix)
    path = os.path.join(folder, "config.json")
    record = json_file(path, "export config", fix, keys=("megalite.model", "megalite.tokenizer"))["megalite"]
    cfg = model_config(record["model"], f"export config {path}")
    weights = read_weights(os.path.join(folder, "model.safetensors"), "export weights", fix)
    try:
        state = from_hf(weights, cfg) if architecture(cfg).hf_layout(cfg) is not None else weights
    except KeyError as e:
        raise ConfigError(f"export weights {folder}/model.safetensors lack the tensor {e} that its config.json's "
                          f"model needs; fix: {fix}") from None
    return cfg, state, check_meta(record["tokenizer"], f"the tokenizer record of export config {path}", fix)


def add_trained_arguments(parser, use: str) -> None:
    """A command's --out_dir (a run's checkpoint, `use` saying what the command does with it), --export and --tag:
    the three arguments load_trained reads."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--out_dir", help=f"a run's train.out_dir: {use} its checkpoint")
    source.add_argument("--export", help="a folder written by python -m scripts.export, or a Hugging Face model's "
                                         "(config.json, safetensors weights, tokenizer.json)")
    parser.add_argument("--tag", help="with --out_dir: the checkpoint tag (default: the newest)")


def load_trained(out_dir: str | None, tag: str | None = None, export_dir: str | None = None,
                 head: str = "lm", context: int | None = None, dtype: torch.dtype = torch.float32) -> tuple:
    """(model config, model holding its weights on the CPU at `dtype`, tokenizer, its dataset's meta) of an export, of
    a Hugging Face model's folder (training/checkpoints/hf_folder.py; `context` caps its rotary model's block_size),
    or of a run's checkpoint (`tag`, or its newest) of any layout, its slices merged. `head`: the model.head the
    caller uses (lm: sampling, serving, evaluation; score: a reward model's scores); another is refused."""
    if is_hf_folder(export_dir):
        cfg, model, tokenizer, meta = load_hf_folder(export_dir, context, dtype)
        _check_head(cfg, head, export_dir)
        return cfg, model, tokenizer, meta
    if export_dir:
        cfg, state, meta = load_export(export_dir)
        _check_head(cfg, head, export_dir)
        fix = "an export's tokenizer stays beside its config.json; export the checkpoint again"
        return *_with_weights(cfg, state, export_dir, dtype), tokenizer_from_meta(meta, export_dir, fix), meta
    tag_dir = checkpoint.find_checkpoint(out_dir, tag)
    run_state = checkpoint.read_run_state(tag_dir)
    meta, data_dir = run_dataset(tag_dir, run_state)
    cfg = run_model(tag_dir, run_state)
    _check_head(cfg, head, tag_dir)
    return (*_with_weights(cfg, consolidated_state_dict(tag_dir), tag_dir, dtype), tokenizer_from_meta(meta, data_dir),
            meta)


def _check_head(cfg: ModelConfig, head: str, source: str) -> None:
    if cfg.head == head:
        return
    if head == "lm":
        raise ConfigError(f"{source} holds a reward model (model.head=score): it scores whole sequences and has no "
                          f"next-token logits to sample, serve or evaluate with; fix: pass a language model, or "
                          f"score with training.reward_model.load_reward_model")
    raise ConfigError(f"{source} holds a language model (model.head={cfg.head}), not a reward model; fix: pass the "
                      f"export of a train.objective=reward run (model.head=score)")


def _with_weights(cfg: ModelConfig, state: dict, source: str, dtype: torch.dtype) -> tuple:
    """(config, model): the model of `cfg` holding `state` at `dtype`, the weights read from `source`, LoRA's
    adapters merged into the weights they adapt (sampling and serving run it as one model, its linear maps packed
    where oneDNN is faster)."""
    cfg, state = merged(cfg, state)
    model = build_empty(cfg, dtype)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # names or shapes that another model's export would have
        why = " ".join(str(e).split())[:300]
        raise ConfigError(f"the weights of {source} do not fit its model settings ({why}); fix: export the "
                          f"checkpoint again with python -m scripts.export") from None
    return cfg, model


def read_weights(path: str, what: str, fix: str) -> dict:
    """The tensors of a safetensors file; `what` names it in the ConfigError of a missing or unreadable one."""
    existing_file(path, what, fix)
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{what} {path} are not a safetensors file ({e}); fix: {fix}") from None


if __name__ == "__main__":
    from common.checks import not_a_command

    not_a_command("training.checkpoints.export", "python -m scripts.export")
