"""Checkpoints: DeepSpeed's own save and load on every rank, made safe to kill and checked before loading.

    <out_dir>/checkpoints/
        step_000100/          DeepSpeed's files (model states, optimizer and ZeRO shards, per rank or layer)
            run_state.json    step, tokens seen, run config, layout: what resuming needs before an engine exists
            manifest.json     every file with its size, written last: its presence marks a complete checkpoint
        latest                the newest complete tag, replaced atomically once manifest.json is written

`latest` moves only after every rank has finished writing (a barrier) and the manifest is down, so a
run killed at any moment of a save leaves the previous checkpoint resumable. With train.background_save the
files are written by a thread while training goes on (training/checkpoints/background_save.py), and the checkpoint is
completed at the first step after every rank's files are down. What a damaged checkpoint would trip over (a
missing shard, a truncated file, a tag that does not exist, a file that pickles more than tensors and DeepSpeed's
settings) is found here, before DeepSpeed loads anything, and nothing is overwritten; what resuming one would
change (its architecture, its layout, newer checkpoints) training/checkpoints/resume.py checks.
"""
import contextlib
import json
import os
import re
import shutil

import torch
from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, UNIVERSAL_CHECKPOINT_INFO
from deepspeed.checkpoint.universal_checkpoint import SubparamShape
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from common.checks import ConfigError, existing_dir, json_file
from data.writer import write_atomic
from model.config import saved_settings_gaps
from training.checkpoints import experts, universal
from training.checkpoints.background_save import BackgroundWriter
from training.optim import rate_from_schedule

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
RUN_STATE = "run_state.json"
TAG = re.compile(r"^step_(\d+)(_universal)?$")
# What resuming, export and sampling read from run_state.json before any file of DeepSpeed's ("a.b": key b of a).
RUN_STATE_KEYS = ("tag", "step", "config.model", "layout.dp", "layout.pp", "layout.zero_stage")


def checkpoint_root(out_dir: str) -> str:
    return os.path.join(out_dir, CHECKPOINTS)


def tag_for(step: int) -> str:
    return f"step_{step:06d}"


def tag_step(tag: str) -> int:
    return int(TAG.match(tag).group(1))


def save(engine, out_dir: str, step: int, run_state: dict, keep: int, uc_info: dict) -> str:
    """Collective: every rank calls it. uc_info: universal_info of the run. Returns the new tag. With a
    BackgroundWriter (training/checkpoints/background_save.py) it returns once the files are in host memory, and
    settle() completes the checkpoint once they are written."""
    settle(engine)  # one save in flight at a time
    root, tag = checkpoint_root(out_dir), tag_for(step)
    # DeepSpeed's MoE save reserves the universal converter's key (which its converter, not used for experts,
    # reads: training/checkpoints/experts.py converts them).
    client_state = {} if engine.has_moe_layers else {UNIVERSAL_CHECKPOINT_INFO: uc_info}
    with experts.every_tensor_rank_writes(engine):
        engine.save_checkpoint(root, tag=tag, client_state=client_state,
                               save_latest=False)  # `latest` is ours to move, once the checkpoint is complete
    unfinished = (os.path.join(root, tag), run_state, keep)
    if isinstance(engine.checkpoint_engine, BackgroundWriter):
        engine.checkpoint_engine.unfinished = unfinished
    else:
        complete(*unfinished)
    return tag


def settle(engine, wait: bool = True) -> str | None:
    """Collective: complete the checkpoint a BackgroundWriter is writing once every rank's files are down:
    waiting for them, or (wait=False, a check each step) only if they are down already. Returns its tag, or
    None when nothing was completed."""
    writer = engine.checkpoint_engine
    if getattr(writer, "unfinished", None) is None or not (wait or writer.written_everywhere()):
        return None
    writer.wait()
    unfinished, writer.unfinished = writer.unfinished, None
    complete(*unfinished)
    return os.path.basename(unfinished[0])


def complete(tag_dir: str, run_state: dict, keep: int) -> None:
    """Collective, once every rank has written its files: the run state and manifest, then `latest`."""
    torch.distributed.barrier()  # every rank has written its files
    if torch.distributed.get_rank() == 0:
        mark_complete(tag_dir, run_state)
        root = os.path.dirname(tag_dir)
        write_atomic(os.path.join(root, LATEST), os.path.basename(tag_dir).encode())
        prune(root, keep)
    torch.distributed.barrier()


def mark_complete(tag_dir: str, run_state: dict) -> None:
    """run_state.json, then the manifest of every file (itself last): the checkpoint now counts."""
    write_atomic(os.path.join(tag_dir, RUN_STATE), json.dumps(run_state, indent=1).encode())
    files = {}
    for folder, _, names in os.walk(tag_dir):
        for name in names:
            path = os.path.join(folder, name)
            if name != MANIFEST:
                files[os.path.relpath(path, tag_dir)] = os.path.getsize(path)
    write_atomic(os.path.join(tag_dir, MANIFEST), json.dumps({"files": dict(sorted(files.items()))}, indent=1).encode())


def complete_tags(root: str) -> list[str]:
    """Tags with a manifest, oldest first."""
    if not os.path.isdir(root):
        return []
    tags = [t for t in os.listdir(root) if TAG.match(t) and os.path.exists(os.path.join(root, t, MANIFEST))]
    return sorted(tags, key=lambda t: (tag_step(t), t))


def prune(root: str, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (never fewer than one) and drop older partial ones."""
    complete = complete_tags(root)
    newest_step = tag_step(complete[-1])
    doomed = complete[:-max(keep, 1)]
    doomed += [t for t in os.listdir(root) if TAG.match(t) and t not in complete
               and tag_step(t) < newest_step]  # leftovers of a killed save
    for tag in doomed:
        shutil.rmtree(os.path.join(root, tag), ignore_errors=True)


def find_checkpoint(out_dir: str, tag: str | None = None, what: str = "--tag", fresh_ok: bool = False) -> str | None:
    """The directory of checkpoint `tag` of the run in out_dir (a tag, or the path of a checkpoint anywhere), or
    without a tag the newest complete one, which `latest` names: the one lookup behind train.resume and every
    tool's --out_dir/--tag. `what` names the setting or flag that gave the tag. A tag that is not there or a
    damaged `latest` raise ConfigError; so do an out_dir that is no run's and one without a checkpoint, unless
    `fresh_ok` (a run that starts fresh there: None)."""
    root = checkpoint_root(out_dir)
    if not fresh_ok:
        existing_dir(out_dir, "--out_dir", "pass the train.out_dir of a run")
    available = complete_tags(root)
    if tag is None:
        latest = os.path.join(root, LATEST)
        if not os.path.exists(latest):
            if fresh_ok:
                return None
            raise ConfigError(f"--out_dir {out_dir} holds no complete checkpoint (no {latest}); fix: pass the "
                              f"train.out_dir of a run that saved one, or name one with --tag")
        with open(latest) as f:
            tag = f.read().strip()
        if not TAG.match(tag):
            raise ConfigError(f"{latest} names no checkpoint ({tag!r}): it is damaged; fix: write the newest complete "
                              f"tag into it ({', '.join(available[-1:]) or 'none'}), or name one with {what}=TAG")
        return os.path.join(root, tag)
    path = tag if os.path.isdir(tag) else os.path.join(root, tag)
    if not os.path.isdir(path):
        raise ConfigError(f"{what}={tag}: no such checkpoint. Complete ones in {root}: "
                          f"{', '.join(available) or 'none'}")
    return path


def read_run_state(tag_dir: str) -> dict:
    """Check that the checkpoint is complete and intact on this machine, and return its run state."""
    manifest_path = os.path.join(tag_dir, MANIFEST)
    if not os.path.exists(manifest_path):
        advice = elsewhere(tag_dir, "resume from an earlier tag")
        raise ConfigError(f"{tag_dir} is not a complete checkpoint (no {MANIFEST}: its save never finished). "
                          f"{advice[0].upper()}{advice[1:]}")
    manifest = json_file(manifest_path, "checkpoint manifest", elsewhere(tag_dir), keys=("files",))["files"]
    for name, size in manifest.items():
        path = os.path.join(tag_dir, name)
        if not os.path.exists(path):
            raise ConfigError(f"checkpoint file {path} is missing (a ZeRO shard or layer file this run needs; "
                              f"checkpoints must sit on storage every node can read); fix: "
                              f"{elsewhere(tag_dir, 'restore the file, or resume from another tag')}")
        if os.path.getsize(path) != size:
            raise ConfigError(f"checkpoint file {path} is corrupt: {os.path.getsize(path):,} bytes, {size:,} when "
                              f"saved; fix: {elsewhere(tag_dir)}")
    check_pickles(tag_dir, manifest)
    path = os.path.join(tag_dir, RUN_STATE)
    state = json_file(path, "checkpoint run state", elsewhere(tag_dir), keys=RUN_STATE_KEYS)
    check_current(state, path)
    return state


def check_current(state: dict, path: str) -> None:
    """Refuse the run state of a checkpoint saved by an earlier version of this repo (before the Llama settings,
    tensor parallelism or the data record): the project has had no release, so old formats are not converted."""
    missing = [f"config.model.{name}" for name in saved_settings_gaps(state["config"]["model"])[0]]
    missing += [key for key, held in (("layout.tp", "tp" in state["layout"]), ("data", "data" in state)) if not held]
    if missing:
        raise ConfigError(f"checkpoint run state {path} lacks {', '.join(missing)}: it was saved by an earlier version "
                          f"of this repo, which this one does not read; fix: resume or export it with that version "
                          f"(python -m scripts.export), then start from the export with train.init_from=EXPORT_DIR")


def elsewhere(tag_dir: str, advice: str = "resume from another tag") -> str:
    """What to do about a broken checkpoint: `advice` and the run's other complete tags, or, when there is none,
    that there is none and what is left."""
    root, tag = os.path.split(os.path.normpath(tag_dir))
    others = [t for t in complete_tags(root) if t != tag]
    if others:
        return f"{advice}: {', '.join(others)}"
    return (f"there is no other complete checkpoint in {root}: start fresh with train.resume=none in another "
            f"train.out_dir, or restore the checkpoint's files from a copy")


# Besides tensors and plain containers, DeepSpeed pickles only these into its checkpoint files (ZeRO 0-3,
# bf16 and fp32, pipeline layer files, universal ones), as torch.serialization.get_unsafe_globals_in_checkpoint
# lists them. Anything else could run code when unpickled, so it is refused.
# fp16/fp32 loss scaler, ZeRO stage, bf16 ZeRO map, a fused tensor-parallel weight's layout (universal files)
SAFE_GLOBALS = [LossScaler, ZeroStageEnum, fragment_address, SubparamShape]


def check_pickles(tag_dir: str, manifest: dict) -> None:
    """Refuse a checkpoint any of whose torch files pickles an object weights_only loading would not allow,
    before anything (DeepSpeed's own loaders and converter included, which unpickle everything) reads it.
    A static scan of each file's pickle, not of its tensors: it costs little."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        for name in manifest:
            if name.endswith(".pt"):
                path = os.path.join(tag_dir, name)
                try:
                    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
                except Exception as e:  # torch raises ValueError, RuntimeError, EOFError, ...
                    why = " ".join(str(e).split())  # one line, whatever torch's message
                    raise ConfigError(f"checkpoint file {path} is corrupt: it is not a torch file ({why}); fix: "
                                      f"{elsewhere(tag_dir)}") from None
                if unsafe:
                    raise ConfigError(f"checkpoint file {path} pickles {', '.join(sorted(unsafe))}, which is not a "
                                      f"tensor or a setting DeepSpeed saves: refused, since unpickling it could run "
                                      f"code. Load only checkpoints you trust, from their own writer")


def load_state_file(path: str, mmap: bool = False):
    """One torch file of a checkpoint, weights_only (tensors, containers and SAFE_GLOBALS only), on the CPU; `mmap`:
    its tensors mapped from the file, read only if used."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def load(engine, tag_dir: str) -> dict:
    """Collective: load model, optimizer, scheduler and ZeRO shards; returns the run state (its "step" is the
    step to continue after)."""
    with open(os.path.join(tag_dir, RUN_STATE)) as f:
        state = json.load(f)
    universal_form = state.get("universal")
    names = experts.expert_names(engine) if universal_form and engine.has_moe_layers else \
        contextlib.nullcontext()
    try:
        with names:
            path = _load_into(engine, tag_dir, universal_form)
        if universal_form:
            universal.load_module_entries(engine, tag_dir)
    except Exception as e:  # a file that passed the size check but does not unpickle
        raise ConfigError(f"could not load checkpoint {tag_dir}: {type(e).__name__}: {e}") from None
    if path is None:
        raise ConfigError(f"DeepSpeed found no checkpoint to load in {tag_dir}")
    rate_from_schedule(engine)
    return state


def _load_into(engine, tag_dir: str, universal_form: bool) -> str | None:
    """DeepSpeed's load_checkpoint, and the universal checkpoint's optimizer states it does not load."""
    # DeepSpeed reads a universal checkpoint's weights and optimizer states into its ZeRO optimizers only
    # (and BF16_Optimizer, from ZeRO's loading path); without ZeRO it hands the model-states file's optimizer
    # entry, None in a universal checkpoint, to the optimizer: TypeError. Those states are loaded here first,
    # then DeepSpeed loads the rest (schedule, counters) with its optimizer loading off.
    without_zero = universal_form and not engine.zero_optimization()
    copy_masters = universal.load_universal_without_zero(engine, tag_dir, load_state_file(os.path.join(
        tag_dir, "zero", "optimizer_state.pt"))["param_groups"]) if without_zero else None
    if copy_masters and not hasattr(engine.optimizer, "update_lp_params"):
        engine.optimizer.update_lp_params = copy_masters  # DeepSpeed calls it after a universal load
    try:
        path, _ = engine.load_checkpoint(os.path.dirname(tag_dir), tag=os.path.basename(tag_dir),
                                         load_optimizer_states=not without_zero, load_lr_scheduler_states=True)
    finally:
        if copy_masters and engine.optimizer.update_lp_params is copy_masters:
            del engine.optimizer.update_lp_params
    if universal_form and engine.zero_optimization_stage() == 3:
        _mend_zero3_universal_load(engine.optimizer, tag_dir)
    return path


def _mend_zero3_universal_load(optimizer, tag_dir: str) -> None:
    """What DeepSpeed's ZeRO-3 universal loader leaves wrong (ZeRO 1-2's sets both right): it gives every parameter
    group the first one's settings, the matrices' weight decay to the biases and gains too; and one step tensor to
    every sub-group's state, which torch's fused AdamW then counts once per sub-group a step (the second group's
    moments corrected as a step later's). Each group's own settings from the checkpoint, each state its own step."""
    saved = load_state_file(os.path.join(tag_dir, "zero", "optimizer_state.pt"))[OPTIMIZER_STATE_DICT]
    for group, own in zip(optimizer.optimizer.param_groups, saved["param_groups"], strict=True):
        group.update({key: value for key, value in own.items() if key != "params"})
    for flat in optimizer.fp32_partitioned_groups_flat:
        state = optimizer.optimizer.state[flat]
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


if __name__ == "__main__":
    from common.checks import not_a_command

    not_a_command("training.checkpoints.checkpoint", "python -m scripts.convert_checkpoint")
