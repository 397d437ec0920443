"""DeepSpeed's universal checkpoint format, in which a checkpoint resumes on another layout: what its converter
needs to know of the model (`universal_info`, saved in each checkpoint), which checkpoints convert and how
(DeepSpeed's converter for ZeRO shards, this module for ZeRO-0's whole optimizer state), and a universal
checkpoint loaded into a ZeRO-0 engine, which DeepSpeed's loader does not do. The command is
`python -m scripts.convert_checkpoint universal`, which checks the checkpoint first."""
import argparse
import contextlib
import glob
import io
import os
import re
import shutil
import types

import torch
from deepspeed.checkpoint import ds_to_universal
from deepspeed.checkpoint.constants import (
    CAT_DIM,
    FP32_WEIGHT_KEY,
    PARAM,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    PIPELINE_REPLICATED_PARAMETER_PATTERNS,
    SUB_PARAM_SHAPE,
    SUB_PARAM_SHARD_WIDTHS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)
from deepspeed.checkpoint.universal_checkpoint import SubparamShape, load_hp_checkpoint_state
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.runtime.zero import GatheredParameters
from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank, bwc_tensor_model_parallel_world_size
from deepspeed.utils.tensor_fragment import fragment_address

from common.checks import ConfigError
from model import build_model
from model.config import ModelConfig, model_config
from model.registry import ARCHITECTURES
from model.tensor_parallel import ROW, TensorParallel, shard_parameter, split_rule
from training.optim import decay_split


def universal_info(cfg: ModelConfig, tp_size: int) -> dict:
    """What DeepSpeed's universal-checkpoint converter needs to merge a checkpoint, from the model (every layer's
    parameters as one tensor rank holds them, on the meta device: a pipeline stage holds only its own, and the
    converter reads one stage's file for the whole model's rules): the tied embedding is held by the first and the
    last pipeline stage, and only one copy must be kept; each parameter's tensor-parallel rule (split_rules) as
    DeepSpeed's patterns: replicated ones keep one slice, row-parallel ones join on dim 1, fused q|k|v join block by
    block, the rest (column-parallel, vocabulary rows) on dim 0. The loader cuts them again for the resuming run's
    degree, so they are recorded at tp = 1 too, where there is nothing to join. Only what the optimizer holds, which
    the converter reads: not LoRA's frozen weights, whose patterns it would find unused."""
    info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            PIPELINE_REPLICATED_PARAMETER_PATTERNS: [r"tied_modules\..*"]}
    with torch.device("meta"):
        named = list(build_model(cfg, tp=TensorParallel(tp_size)).named_parameters())
    shapes = {name: p.shape for name, p in named if p.requires_grad}
    rules = {name: split_rule(p) for name, p in named} if tp_size > 1 else split_rules(cfg)
    if not rules:
        return info  # a model that splits over no tensor ranks
    exact = {name: f"^{re.escape(name)}$" for name in shapes}
    info[TP_REPLICATED_PARAMETER_PATTERNS] = [exact[n] for n in shapes if rules[n] is None]
    info[PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] = [exact[n] for n in shapes if rules[n] == ROW]
    info[PARAMETER_WITH_SUB_PARAMS], info[SUB_PARAM_SHARD_WIDTHS] = [], {}
    for name in shapes:
        if isinstance(rules[name], tuple):  # (COLUMN, parts)
            parts, param = rules[name][1], shapes[name]
            block = param[0] // parts * tp_size  # rows of one of q, k, v in the whole weight
            info[PARAMETER_WITH_SUB_PARAMS].append(
                {"patterns": [exact[name]], "shape": ((block,) * parts, *param[1:]), "partition_dim": 0})
            info[SUB_PARAM_SHARD_WIDTHS][exact[name]] = [[block // tp_size] * tp_size for _ in range(parts)]
    return info


def split_rules(cfg: ModelConfig) -> dict:
    """Each parameter's tensor-parallel split rule, which the architecture's plan gives it at every degree: read
    from the model built on the meta device at the smallest degree it splits at (none if it splits at none up to
    8)."""
    for size in range(2, 9):
        try:
            with torch.device("meta"):
                return {name: split_rule(p) for name, p in build_model(cfg, tp=TensorParallel(size)).named_parameters()}
        except ConfigError:
            continue
    return {}


def _entry(name: str, tensor: torch.Tensor, info: dict) -> dict:
    """A parameter's (or one of its Adam moments') universal file as DeepSpeed's converter writes it for a
    checkpoint of one tensor rank, by `info`'s patterns: what tells the loader how to cut it for another degree."""
    exact = f"^{re.escape(name)}$"
    for sub in info.get(PARAMETER_WITH_SUB_PARAMS, []):
        if exact in sub["patterns"]:
            return {PARAM: tensor, SUB_PARAM_SHAPE: SubparamShape(**sub)}
    if exact in info.get(TP_REPLICATED_PARAMETER_PATTERNS, []):
        return {PARAM: tensor}
    return {PARAM: tensor, CAT_DIM: 1 if exact in info.get(PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, []) else 0}


class _WholeFragment:
    """What DeepSpeed's universal loader (load_hp_checkpoint_state) fills for a ZeRO partition's fragment of a
    parameter: under ZeRO-0 the fragment is the whole parameter (this tensor rank's slice of it)."""

    def __init__(self, master: torch.Tensor):
        self.master = master
        self.lp_fragment_address = fragment_address(numel=master.numel(), start=0)
        self.optim_fragment = {}

    def get_hp_fragment(self) -> torch.Tensor:
        return self.master.data.view(-1)


def load_universal_without_zero(engine, tag_dir: str, saved_groups: list):
    """A universal checkpoint's fp32 weights and Adam states (`saved_groups`: its optimizer's parameter groups) into
    a ZeRO-0 engine's optimizer; returns what copies its fp32 masters into the model's weights, or None where
    DeepSpeed's optimizer does that itself."""
    optimizer = engine.optimizer
    if isinstance(optimizer, BF16_Optimizer):  # a bf16 pipeline: DeepSpeed's loader, given the folder
        optimizer.load_state_dict(None, checkpoint_folder=tag_dir, load_optimizer_states=True,
                                  load_from_fp32_weights=True)
        return None
    if isinstance(optimizer, FP16_UnfusedOptimizer):  # bf16 or fp16: fp32 masters beside the model's weights
        basic, weights = optimizer.optimizer, optimizer.fp16_groups
    else:  # fp32: torch's AdamW steps the model's own weights
        basic, weights = optimizer, [group["params"] for group in optimizer.param_groups]
    tp_rank, tp_size = bwc_tensor_model_parallel_rank(engine.mpu), bwc_tensor_model_parallel_world_size(engine.mpu)
    states, groups, index = {}, [], 0
    for group, saved_group, lps in zip(basic.param_groups, saved_groups, weights):
        ids = []
        for master, lp in zip(group["params"], lps):
            fragment = _WholeFragment(master)
            target = types.SimpleNamespace(shape=master.shape, numel=master.numel, _hp_mapping=fragment)
            step = load_hp_checkpoint_state(target, os.path.join(tag_dir, "zero", engine.param_names[lp]), tp_rank,
                                            tp_size)  # the fp32 weight written into the master, cut for tp_rank
            if fragment.optim_fragment:
                states[index] = {"step": torch.as_tensor(step, dtype=torch.float32),
                                 **{key: value.view_as(master) for key, value in fragment.optim_fragment.items()}}
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       **{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    basic.load_state_dict({"state": states, "param_groups": groups})  # torch places each state by its parameter

    def copy_masters():
        if basic is not optimizer:
            for masters, lps in zip(optimizer.fp32_groups, optimizer.fp16_groups):
                for master, lp in zip(masters, lps):
                    lp.data.copy_(master.data)
    return copy_masters


def write_entries(target: str, tensors: dict) -> None:
    """Module entries the optimizer does not hold, whole, as zero/<name>/fp32.pt (load_module_entries reads them):
    a biased router's buffers (training/checkpoints/experts.py), LoRA's frozen weights."""
    for name, tensor in tensors.items():
        folder = os.path.join(target, "zero", name)
        os.makedirs(folder, exist_ok=True)
        torch.save({PARAM: tensor}, os.path.join(folder, f"{FP32_WEIGHT_KEY}.pt"))


def load_module_entries(engine, tag_dir: str) -> None:
    """A universal checkpoint's module entries into the engine's model, which DeepSpeed's loader, restoring the
    optimizer's parameters only, leaves: buffers, and LoRA's frozen weights, each cut for this tensor rank (and,
    under ZeRO-3, written whole and partitioned again) as train.init_from's are."""
    model = engine.module
    saved = model.state_dict()  # persistent buffers only
    for name, buffer in model.named_buffers():
        path = os.path.join(tag_dir, "zero", name, f"{FP32_WEIGHT_KEY}.pt")
        if name in saved and os.path.exists(path):
            buffer.copy_(torch.load(path, map_location="cpu", weights_only=True)[PARAM])
    tp = TensorParallel(bwc_tensor_model_parallel_world_size(engine.mpu), bwc_tensor_model_parallel_rank(engine.mpu))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.requires_grad:
                path = os.path.join(tag_dir, "zero", name, f"{FP32_WEIGHT_KEY}.pt")
                whole = torch.load(path, map_location="cpu", weights_only=True)[PARAM]
                with GatheredParameters([param], modifier_rank=0):
                    param.copy_(shard_parameter(whole, split_rule(param), tp))


def has_optimizer_shards(tag_dir: str) -> bool:
    """ZeRO 1-3 and bf16 pipelines save optimizer shards, which DeepSpeed's converter reads; ZeRO-0 otherwise keeps
    the whole optimizer state in its model-states files."""
    return bool(glob.glob(os.path.join(tag_dir, "*zero_pp_rank_*optim_states.pt")))  # not an expert rank's


def unconvertible(tag_dir: str, saved: dict) -> str | None:
    """Why the checkpoint (`saved`: its run state) cannot be converted to the universal format, with what to do
    instead; None if it can."""
    layout, tag = saved["layout"], os.path.basename(os.path.normpath(tag_dir))
    if saved["config"]["model"].get("lora_rank") and saved["config"]["model"].get("n_experts"):
        out_dir = os.path.dirname(os.path.dirname(os.path.normpath(tag_dir)))
        return (f"{tag_dir} is a LoRA run's checkpoint over a mixture of experts, whose frozen experts the experts' "
                f"converter does not read. Resume it on its own layout (pp={layout['pp']}, tp={layout['tp']}, "
                f"ZeRO-{layout['zero_stage']}), or start a new run from its weights, the adapters merged: python -m "
                f"scripts.export --out_dir {out_dir} --tag {tag}, then train.init_from={out_dir}/export/{tag}")
    if saved["config"]["model"].get("n_experts"):
        return _unconvertible_experts(tag_dir, layout)
    if layout["tp"] > 1 and layout["zero_stage"] == 3:
        return (f"{tag_dir} is a ZeRO-3 checkpoint at tensor-parallel degree {layout['tp']}: DeepSpeed's converter "
                f"merges ZeRO-3 shards of one tensor slice only. Resume it at tp={layout['tp']}, or train with "
                f"ZeRO-1/2 to change the degree later")
    if not has_optimizer_shards(tag_dir) and (layout["pp"] > 1 or layout["tp"] > 1):
        where = f"over {layout['pp']} pipeline stages" if layout["pp"] > 1 else \
            f"at tensor-parallel degree {layout['tp']}"
        out_dir = os.path.dirname(os.path.dirname(os.path.normpath(tag_dir)))
        in_hf_layout = bool(ARCHITECTURES[saved["config"]["model"]["arch"]].hf)  # what an export can start
        weights = "" if not in_hf_layout else (
            f", or start a new run from its weights: python -m scripts.export --out_dir {out_dir} --tag {tag}, then "
            f"train.init_from={out_dir}/export/{tag}")
        return (f"{tag_dir} is a ZeRO-0 checkpoint {where}, whose optimizer state no converter reads: resume it on "
                f"its own layout (pp={layout['pp']}, tp={layout['tp']}){weights}")
    if layout["tp"] == 1 and has_optimizer_shards(tag_dir) and not records_split_rules(tag_dir, saved):
        return (f"{tag_dir} was saved at tp=1 before checkpoints recorded how each parameter splits over tensor "
                f"ranks: converted, it would resume at tp > 1 with its row-parallel and fused weights cut wrongly. "
                f"Resume it on its own layout (pp={layout['pp']}, tp=1, ZeRO-{layout['zero_stage']}) and convert a "
                f"checkpoint saved after that")
    return None


def records_split_rules(tag_dir: str, saved: dict) -> bool:
    """Whether a checkpoint's universal_info (in its model-states file, which DeepSpeed's converter reads) holds
    the split rules its model has."""
    from training.checkpoints.checkpoint import load_state_file  # which imports this module

    path = sorted(glob.glob(os.path.join(tag_dir, "*mp_rank_00_model_states.pt")))[0]
    info = load_state_file(path, mmap=True).get(UNIVERSAL_CHECKPOINT_INFO, {})  # the tensors mapped, not read
    model = model_config(saved["config"]["model"], f"the run state of {tag_dir}")
    return TP_REPLICATED_PARAMETER_PATTERNS in info or not split_rules(model)


def _unconvertible_experts(tag_dir: str, layout: dict) -> str | None:
    """Why a mixture of experts' checkpoint cannot be converted (training/checkpoints/experts.py reads ZeRO
    shards of one tensor rank, or a ZeRO-0 checkpoint of one stage and one tensor rank), or None."""
    saved_at = f"pp={layout['pp']}, tp={layout['tp']}, ZeRO-{layout['zero_stage']}"
    if layout["tp"] > 1:
        return (f"{tag_dir} is a mixture of experts' checkpoint at {saved_at}: its experts convert from one tensor "
                f"rank only. Resume it on its own layout, or train at tp=1 to change the layout later")
    if layout["zero_stage"] == 0 and layout["pp"] > 1:
        return (f"{tag_dir} is a mixture of experts' ZeRO-0 checkpoint over {layout['pp']} pipeline stages, whose "
                f"optimizer state no converter reads: resume it on its own layout ({saved_at}), or train with "
                f"ZeRO-1 to change the layout later")
    return None


def convert(source: str, target: str) -> None:
    """DeepSpeed's universal-checkpoint converter, run in this process with one worker (its pools would fork this
    process) and its progress output silenced: a failure is one line, whose fix says how to see that output."""
    args = argparse.Namespace(input_folder=source, output_folder=target, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal.main(args)
    except Exception as error:
        shutil.rmtree(target, ignore_errors=True)  # half a conversion is no checkpoint
        raise ConfigError(f"DeepSpeed's universal converter failed on {source} ({type(error).__name__}: {error}); "
                          f"fix: see its whole output with python -m deepspeed.checkpoint.ds_to_universal "
                          f"--input_folder {source} --output_folder {target}, or convert another tag") from None


def convert_zero0(source: str, target: str, saved: dict, states: dict) -> None:
    """A ZeRO-0 checkpoint of one stage and one tensor rank in the universal format. Its model-states file holds
    the whole optimizer state, which DeepSpeed's converter does not read (it reads ZeRO shards): written here as
    its loaders read it, zero/<name>/fp32.pt, exp_avg.pt, exp_avg_sq.pt and step.pt per parameter and
    zero/optimizer_state.pt, beside the model-states file without its optimizer entry (`states`: that file,
    read safely)."""
    order, info = optimizer_order(saved, source), one_rank_info(saved, source)
    try:
        adam = write_parameters(target, order, states["optimizer"], states["module"], source, info)
        torch.save({"ds_version": states["ds_version"], "param_groups": adam["param_groups"]},
                   os.path.join(target, "zero", "optimizer_state.pt"))
        torch.save({**states, "optimizer": None}, os.path.join(target, "mp_rank_00_model_states.pt"))
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)  # half a conversion is no checkpoint
        raise


def optimizer_order(saved: dict, source: str) -> list[tuple[str, torch.Size]]:
    """The parameters of the checkpoint's model (`saved`: its run state), names and shapes, in the order train.py
    gave the optimizer: the model built on the meta device."""
    with torch.device("meta"):
        model = build_model(model_config(saved["config"]["model"], f"the run state of {source}"))
    decay, no_decay = decay_split(model.named_parameters())
    return [(name, p.shape) for name, p in decay + no_decay]


def one_rank_info(saved: dict, source: str) -> dict:
    """universal_info of a checkpoint of one tensor rank (`saved`: its run state)."""
    return universal_info(model_config(saved["config"]["model"], f"the run state of {source}"), 1)


def write_parameters(target: str, order: list, optimizer: dict, module: dict, source: str, info: dict,
                     skip: frozenset = frozenset()) -> dict:
    """Each parameter of `order` ((name, shape) in the optimizer's order) but those in `skip`, from a ZeRO-0
    optimizer's whole state (torch's, or bf16's beside its fp32 masters; the weights of an fp32 run are the
    `module`'s): its fp32 weight and Adam states, as DeepSpeed's universal loaders read them (`info`: the model's
    universal_info at one tensor rank). Returns torch's optimizer state dict."""
    masters = optimizer.get("fp32_groups")  # bf16: DeepSpeed's unfused optimizer keeps fp32 masters
    adam = optimizer["optimizer_state_dict"] if masters is not None else optimizer
    weights = [t for group in masters for t in group] if masters is not None else \
        [module.get(name) for name, _ in order]
    if len(weights) != len(order) or any(w is None or w.shape != shape for (_, shape), w in zip(order, weights)):
        raise ValueError(f"{source}: its optimizer state does not fit the model its run_state.json describes, so "
                         f"it cannot be converted")
    for index, ((name, _), weight) in enumerate(zip(order, weights)):
        if name in skip:
            continue
        folder = os.path.join(target, "zero", name)
        os.makedirs(folder)
        torch.save(_entry(name, weight.float(), info), os.path.join(folder, f"{FP32_WEIGHT_KEY}.pt"))
        for key, value in adam["state"].get(index, {}).items():  # step, exp_avg, exp_avg_sq
            torch.save(value if key == "step" else _entry(name, value, info), os.path.join(folder, f"{key}.pt"))
    return adam
