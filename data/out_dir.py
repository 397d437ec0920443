"""The out_dir a preparation writes, of text (data/prepare.py) or JSONL records (data/jsonl_job.py): the dataset
already there and whether it may be replaced, the workspace of the job's shards, each document's split (and its
setting's check), and the finished dataset, meta.json last."""
import hashlib
import json
import os
import shutil

from data.readers import InputError
from data.writer import SPLITS, merge, read_done, token_dtype, write_atomic

FORMAT = 2  # meta.json's "format": train/val tokens, document index and tokenizer files; only this one is read
WORKSPACE = ".prepare"


def earlier_dataset(out_dir: str) -> dict | None:
    """The meta of the dataset in out_dir ({} for a meta.json that does not read), None where there is none."""
    try:
        with open(os.path.join(out_dir, "meta.json"), "rb") as f:
            meta = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def done_job(out_dir: str, job: str, force: bool, what: str) -> dict | None:
    """The meta of out_dir's dataset when it is already this job's (`what` it holds, for the message); None where
    the job is to run. Another job's dataset is replaced only with --force."""
    meta = earlier_dataset(out_dir)
    if meta is not None and meta.get("job") == job and all(os.path.exists(os.path.join(out_dir, f"{s}.bin"))
                                                           for s in SPLITS):
        print(f"{out_dir} already holds {what}; nothing to do")
        return meta
    if meta is not None and not force:
        raise InputError(f"--out_dir {out_dir} already holds a dataset, of other inputs or options, that this one "
                         f"would replace; fix: pass --force to replace it, or another --out_dir")
    return None


def check_val_fraction(val_fraction: float, empty_val: bool = False) -> None:
    """--val_fraction, before anything is read: below 1, and above 0 unless the val split may be empty (as
    finish_dataset's `empty_val`)."""
    if not (0 <= val_fraction < 1 if empty_val else 0 < val_fraction < 1):  # NaN included
        least = "at least 0" if empty_val else "above 0"
        raise InputError(f"--val_fraction {val_fraction}: must be {least} and below 1; fix: pass the share of the "
                         f"documents held out, e.g. --val_fraction 0.01")


def job_workspace(out_dir: str, job: str) -> str:
    """out_dir/.prepare: the shards of this job; another job's leftovers are removed."""
    workspace = os.path.join(out_dir, WORKSPACE)
    job_path = os.path.join(workspace, "job")
    if not os.path.exists(job_path) or open(job_path).read() != job:
        shutil.rmtree(workspace, ignore_errors=True)
        os.makedirs(os.path.join(workspace, "shards"))
        write_atomic(job_path, job.encode())
    return workspace


def in_val(document: str, val_fraction: float) -> bool:
    """A document's split: a hash of its text, so it does not depend on where the document is."""
    digest = hashlib.blake2b(document.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2**64


def finish_dataset(out_dir, workspace, prefixes, tok, job, files, split_rule: str, delimiter,
                   extra: dict | None = None, empty_val: bool = False, beside: list[str] = ()) -> dict:
    """Merge the shards into the dataset's files, replace out_dir's dataset with them, write meta.json (with
    `extra`, a kind of dataset's own record) last. With `empty_val`, a val split without documents is kept (the
    caller has made sure of the train split: preference sets are often too small to spare pairs). `beside`: files
    the caller wrote into the workspace that the dataset keeps (a prompt set's records)."""
    done = [read_done(p) for p in prefixes]
    counts = {s: {k: sum(d["counts"][s][k] for d in done) for k in ("documents", "tokens")} for s in SPLITS}
    documents_total = sum(c["documents"] for c in counts.values())
    if documents_total == 0 or sum(c["tokens"] for c in counts.values()) == 0:
        raise InputError(f"no documents in {', '.join(files)}: the inputs are empty (or --text_key names an empty "
                         f"field); pass files with text")
    for split in SPLITS:
        if counts[split]["documents"] == 0 and not (split == "val" and empty_val):
            raise InputError(f"no document of the {documents_total:,} fell in the {split} split ({split_rule}): "
                             f"pass more documents, or a --val_fraction that gives each split one")
    dtype = token_dtype(tok.vocab_size)
    for split in SPLITS:
        merge(prefixes, split, workspace, dtype, "")
    meta = {"format": FORMAT, "tokenizer": tok.name, "tokenizer_fingerprint": tok.fingerprint(),
            "vocab_size": tok.vocab_size, "max_token_id": max(d["max_id"] for d in done), "dtype": dtype.name,
            "delimiter": delimiter, "split": split_rule,
            **{f"{s}_tokens": counts[s]["tokens"] for s in SPLITS},
            **{f"{s}_documents": counts[s]["documents"] for s in SPLITS},
            "source": files, "job": job, **tok.meta(), **(extra or {})}
    # Replace the dataset: its old meta.json first (what is left is not trusted), meta.json last.
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)
    masks = [f"{s}.mask" for s in SPLITS if os.path.exists(os.path.join(workspace, f"{s}.mask"))]
    for stale in {f"{s}.mask" for s in SPLITS} - set(masks):  # an earlier conversation dataset's
        if os.path.exists(os.path.join(out_dir, stale)):
            os.remove(os.path.join(out_dir, stale))
    for name in [f"{s}.{ext}" for s in SPLITS for ext in ("bin", "idx")] + masks + list(beside) + tok.save(workspace):
        os.replace(os.path.join(workspace, name), os.path.join(out_dir, name))
    write_atomic(meta_path, json.dumps(meta, indent=1).encode())
    shutil.rmtree(workspace, ignore_errors=True)
    print(f"wrote {out_dir}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens "
          f"({counts['train']['documents']:,} + {counts['val']['documents']:,} documents), vocab "
          f"{meta['vocab_size']:,} ({tok.name}, {dtype.name})")
    return meta
