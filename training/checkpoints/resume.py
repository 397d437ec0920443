"""What a run resumes: the checkpoint train.resume names, what resuming it would overwrite or lose (newer
checkpoints, metrics past its step, a stop before it), and whether this run's model and layout can load it, or
the command that converts it (DeepSpeed's universal format). All of it checked before any process group exists."""
import json
import os
import shutil

from common.checks import ConfigError
from data.writer import write_atomic
from model.config import EARLIER_DEFAULTS, TRAINING_SETTINGS
from model.registry import read_settings
from training.checkpoints import universal
from training.checkpoints.checkpoint import (
    LATEST,
    checkpoint_root,
    complete_tags,
    find_checkpoint,
    tag_for,
    tag_step,
)


def find_resume(out_dir: str, resume: str) -> str | None:
    """The checkpoint train.resume names: 'auto' the newest (None where there is none yet: a fresh start), 'none'
    none (refused where checkpoints are, which a fresh run would overwrite), else a tag or a path."""
    if resume != "none":
        return find_checkpoint(out_dir, None if resume == "auto" else resume, "train.resume", fresh_ok=True)
    available = complete_tags(checkpoint_root(out_dir))
    if available:
        raise ConfigError(f"{out_dir} already holds checkpoints (newest: {available[-1]}); a fresh run would "
                          f"overwrite them. Continue with train.resume=auto, or pick another train.out_dir")
    return None


def check_resume_point(train, tag_dir: str, step: int) -> list[str]:
    """What resuming `tag_dir` at `step` would lose or not do, refused unless asked for (`train`: the run's train
    settings): a train.stop_at_step at or before the step, and newer checkpoints in train.out_dir, which the run
    would overwrite, without train.discard_newer. Returns the newer tags to discard."""
    if train.stop_at_step is not None and train.stop_at_step <= step:
        fix = (f"set it between {step + 1} and train.max_steps={train.max_steps}, or leave it out"
               if step < train.max_steps else f"leave it out: the run is at train.max_steps={train.max_steps} "
                                               f"already")
        raise ConfigError(f"train.stop_at_step={train.stop_at_step} is not past step {step}, where the run resumes "
                          f"({tag_dir}): there is nothing to train; fix: {fix}")
    root = checkpoint_root(train.out_dir)
    newer = [t for t in complete_tags(root) if tag_step(t) > step]
    if newer and not train.discard_newer:
        raise ConfigError(f"resuming {tag_dir} (step {step}) would overwrite the newer checkpoints in {root} "
                          f"({', '.join(newer)}); fix: set train.discard_newer=true to delete them, or resume it "
                          f"in another train.out_dir (train.out_dir=NEW_DIR train.resume={tag_dir})")
    return newer


def discard(out_dir: str, tags: list[str]) -> None:
    """Delete checkpoints `tags` of the run in out_dir (train.discard_newer), `latest` first moved to the newest
    one that stays (or removed), so an interruption leaves train.resume=auto a complete checkpoint."""
    root = checkpoint_root(out_dir)
    staying = [t for t in complete_tags(root) if t not in tags and not t.endswith("_universal")]
    latest = os.path.join(root, LATEST)
    if staying:
        write_atomic(latest, staying[-1].encode())
    elif os.path.exists(latest):
        os.remove(latest)
    for tag in tags:
        shutil.rmtree(os.path.join(root, tag))


def set_aside_metrics(out_dir: str, step: int) -> str | None:
    """metrics.jsonl's records past `step`, which a run resumed at `step` logs again, moved into a file of their
    own, metrics.after_step_NNNNNN.jsonl (.2.jsonl, ... beside an earlier one): never duplicated, never lost.
    Returns what was moved, for the start-up line, or None."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        lines = [line if line.endswith(b"\n") else line + b"\n" for line in f.read().splitlines(keepends=True)]
    keep, past = [], []
    for line in lines:
        try:
            recorded = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):  # a line a kill cut short
            recorded = None
        (keep if isinstance(recorded, int) and recorded <= step else past).append(line)
    if not past:
        return None
    name, n = f"metrics.after_{tag_for(step)}.jsonl", 1
    while os.path.exists(os.path.join(out_dir, name)):
        n += 1
        name = f"metrics.after_{tag_for(step)}.{n}.jsonl"
    write_atomic(os.path.join(out_dir, name), b"".join(past))  # first: a kill in between duplicates, loses nothing
    write_atomic(path, b"".join(keep))
    return f"metrics.jsonl's {len(past)} records past step {step} moved to {name}"


def check_compatible(saved: dict, model_cfg: dict, layout: dict, tag_dir: str | None = None,
                     out_dir: str | None = None) -> None:
    """The checkpoint must hold this architecture; without the universal format, also this layout. tag_dir and
    out_dir (the checkpoint's folder, this run's train.out_dir) make the way to convert it a command to copy."""
    was = {**EARLIER_DEFAULTS, **saved["config"]["model"]}
    changed = {k: (was[k], v) for k, v in read_settings(model_cfg).items()
               if was[k] != v and k not in TRAINING_SETTINGS}
    if changed:
        diff = ", ".join(f"model.{k}: {old} in the checkpoint, {new} now" for k, (old, new) in changed.items())
        raise ConfigError(f"the checkpoint holds a different model architecture ({diff}): resume with the "
                          f"checkpoint's model settings or start a new train.out_dir")
    if saved.get("universal"):
        stage = saved["layout"]["zero_stage"]
        if (stage == 3) != (layout["zero_stage"] == 3):  # ZeRO-3 names its model-states files apart
            fix = "ds_configs/zero3.json" if stage == 3 else "a ZeRO-0, 1 or 2 ds_config (e.g. ds_configs/zero2.json)"
            raise ConfigError(f"the checkpoint is a universal one made from a ZeRO-{stage} checkpoint, this run is "
                              f"ZeRO-{layout['zero_stage']}: DeepSpeed loads one made from ZeRO-3 under ZeRO-3 only, "
                              f"and one made from ZeRO 0-2 under ZeRO 0-2 only; fix: resume it with {fix}")
        return
    was, now, moe = {"ep": 1, **saved["layout"]}, {"ep": 1, **layout}, model_cfg["n_experts"]
    # Without ZeRO every rank saves and loads the whole optimizer state: any dp (and sp) fits, experts apart
    # (their optimizer states are saved per expert-parallel rank).
    if not moe and was["zero_stage"] == now["zero_stage"] == 0 and was["pp"] == now["pp"] == 1 and \
            was["tp"] == now["tp"]:
        return
    if not moe and was["zero_stage"] == 0 and was["tp"] != now["tp"]:
        raise ConfigError(f"the checkpoint was saved at tensor-parallel degree {was['tp']} without ZeRO, this run has "
                          f"{now['tp']}: DeepSpeed's universal converter, which reshards, needs ZeRO optimizer shards. "
                          f"Resume it with tensor_model_parallel_size={was['tp']}, or start from its weights "
                          f"(python -m scripts.export, then train.init_from=EXPORT_DIR)")
    if any(was[key] != now[key] for key in ("dp", "ep", "pp", "tp", "sp", "zero_stage")):
        reason = universal.unconvertible(tag_dir, saved) if tag_dir else None
        if reason:
            raise ConfigError(f"the checkpoint was saved at {_describe(was)}, this run is {_describe(now)}. {reason}")
        tag, source, resume = saved["tag"], "OUT_DIR", f"{saved['tag']}_universal"
        if tag_dir:
            root, tag = os.path.split(os.path.normpath(tag_dir))
            source = os.path.dirname(root)
            in_run = out_dir is not None and os.path.abspath(root) == os.path.abspath(checkpoint_root(out_dir))
            resume = f"{tag}_universal" if in_run else f"{os.path.normpath(tag_dir)}_universal"
        fresh = "; or start this layout fresh in another train.out_dir" if out_dir else ""
        raise ConfigError(
            f"the checkpoint was saved at {_describe(was)}, this run is {_describe(now)}: its optimizer state only "
            f"fits the old layout. Convert it first: python -m scripts.convert_checkpoint universal --out_dir {source} "
            f"--tag {tag}, then resume with train.resume={resume}{fresh}")


def _describe(layout: dict) -> str:
    extra = "".join(f" x {key}={layout.get(key, 1)}" for key in ("tp", "sp", "ep") if layout.get(key, 1) > 1)
    return f"dp={layout['dp']} x pp={layout['pp']}{extra} with ZeRO-{layout['zero_stage']}"
