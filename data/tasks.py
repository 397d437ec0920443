"""Multiple-choice tasks: what the training loop scores (eval.tasks; training/evaluation/multiple_choice.py) and what
`python -m scripts.evaluate` hands lm-evaluation-harness as a local task. One format, HellaSwag's own
validation JSONL, one example a line:

    {"ctx": "A man is sitting on a roof. He", "endings": ["is using wrap ...", "starts ...", ...], "label": 3}

A task is such a file, or `hellaswag`: its validation set, downloaded once into eval.data_dir (placed there by
hand where no network is). Each choice is " " + ending after ctx (build-nanogpt's reading, and the harness's
default target delimiter), tokenized by the run's tokenizer: context and choice each on its own, as the
harness's adapters do (`pair_ids`, the one rule for both).
"""
import errno
import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from common.checks import ConfigError, existing_file
from data.tokenizers import delimiter_id

HELLASWAG = "hellaswag"
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_FILE = "hellaswag_val.jsonl"
FORMAT = 'HellaSwag\'s format: {"ctx": "...", "endings": ["...", "..."], "label": 0}'
DELIMITER = " "  # between a context and each of its endings


@dataclass
class Example:
    context_ids: list[int]
    ending_ids: list[list[int]]
    label: int


@dataclass
class Task:
    name: str
    path: str
    examples: list[Example]


def task_name(spec: str) -> str:
    """A task's name in metrics and results: `hellaswag`, or its file's name without .jsonl."""
    return spec if spec == HELLASWAG else os.path.splitext(os.path.basename(spec))[0]


def task_file(spec: str, data_dir: str) -> str:
    """The JSONL file of eval.tasks entry `spec`: the file itself, or hellaswag's, downloaded on first use."""
    if spec != HELLASWAG:
        return existing_file(spec, "eval.tasks file", f"pass a JSONL file in {FORMAT}, or {HELLASWAG}")
    path = os.path.join(data_dir, HELLASWAG_FILE)
    if not os.path.isfile(path):
        download(HELLASWAG_URL, path, f"place {HELLASWAG_FILE} from there in eval.data_dir={data_dir}")
    return path


def download(url: str, path: str, fix: str, attempts: int = 3, timeout: float = 20, wait: float = 2) -> None:
    """url's bytes into `path`, whole or not at all: every rank that finds it missing fetches its own copy and
    renames it into place, so ranks starting together on one file system never read half of one. A machine
    without a network fails at once: a name that does not resolve, a refused or unreachable connection, no
    answer to connect within `timeout` seconds, or a 4xx answer ends the first attempt in a ConfigError. Only a
    server's trouble is tried again, up to `attempts` in all, `wait` x attempt seconds apart: a 5xx or 429 answer,
    or a transfer that stalls or breaks off once it has begun."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    scratch = f"{path}.tmp{os.getpid()}"
    try:
        for attempt in range(1, attempts + 1):
            try:
                with urllib.request.urlopen(url, timeout=timeout) as response, open(scratch, "wb") as f:
                    f.write(response.read())
                os.replace(scratch, path)
                return
            except (OSError, http.client.HTTPException) as e:  # OSError: URLError, HTTPError, timeouts, a full disk
                if attempt == attempts or not _worth_retrying(e):
                    tried = f" (attempt {attempt} of {attempts})" if attempt > 1 else ""
                    raise ConfigError(f"could not download {url} to {path}{tried}: {_why(e, timeout)}; fix: "
                                      f"{fix}") from None
                time.sleep(wait * attempt)
    finally:
        if os.path.exists(scratch):
            os.remove(scratch)


def _worth_retrying(e: Exception) -> bool:
    """A server's passing trouble; not a machine without a network, a wrong address or a full disk."""
    if isinstance(e, urllib.error.HTTPError):
        return e.code >= 500 or e.code == 429
    if isinstance(e, urllib.error.URLError):  # no answer to connect: DNS, refused, unreachable, connect timeout
        return False
    # After the connection was made: the answer stalls (a timeout), or the connection breaks off.
    return isinstance(e, (TimeoutError, ConnectionError, http.client.HTTPException))


def _why(e: Exception, timeout: float) -> str:
    """What went wrong, in a few words and the system's own."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(reason, socket.gaierror):
        return f"the host name does not resolve, no network? ({reason})"
    if isinstance(reason, ConnectionRefusedError):
        return f"the connection was refused ({reason})"
    if isinstance(reason, OSError) and reason.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return f"the network is unreachable, no network? ({reason})"
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout:g} s ({reason or 'timed out'})"
    return f"{type(reason).__name__}: {reason}"


def read_task(path: str, tokenizer, limit: int | None = None, name: str | None = None) -> Task:
    """The first `limit` examples (all: None) of the JSONL task at `path`, checked and tokenized. A line that is
    not an example, or does not encode whole in `tokenizer`, raises ConfigError naming the file and line."""
    examples = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(examples) == limit:
                break
            if not line.strip():
                continue
            try:
                context, endings, label = example_fields(json.loads(line))
                pairs = [pair_ids(tokenizer, context, DELIMITER + ending) for ending in endings]
                examples.append(Example(pairs[0][0], [ending for _, ending in pairs], label))
            except (ValueError, RecursionError) as e:  # bad JSON (or nested too deep), fields, or a character
                # outside a char vocabulary
                raise ConfigError(f"{path}, line {number}: {e}; fix: write one example a line in {FORMAT}, in text "
                                  f"the run's {tokenizer.name} tokenizer encodes") from None
    if not examples:
        raise ConfigError(f"{path} holds no examples; fix: write one example a line in {FORMAT}")
    return Task(name or task_name(path), path, examples)


def example_fields(record) -> tuple[str, list[str], int]:
    """(ctx, endings, label) of one parsed line; ValueError saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError(f"an example is a JSON object, not {type(record).__name__}")
    missing = [key for key in ("ctx", "endings", "label") if key not in record]
    if missing:
        raise ValueError(f"the example lacks {', '.join(missing)}")
    context, endings, label = record["ctx"], record["endings"], record["label"]
    if not isinstance(context, str) or not context.strip():
        raise ValueError("ctx must be a non-empty string")
    if (not isinstance(endings, list) or len(endings) < 2
            or not all(isinstance(e, str) and e.strip() for e in endings)):
        raise ValueError("endings must be a list of two or more non-empty strings")
    if isinstance(label, str) and label.isdigit():  # the Hugging Face copy of HellaSwag writes "3"
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise ValueError(f"label must be the index of the right ending, 0 to {len(endings) - 1}, not "
                         f"{json.dumps(label)}")
    return context, endings, label


def context_ids(tokenizer, context: str) -> list[int]:
    """A context's ids; an empty one is the document delimiter, what the model saw before any text."""
    ids = tokenizer.encode(context)
    if not ids:
        start = delimiter_id(tokenizer)
        if start is None:
            raise ValueError("the context encodes to no tokens, and the tokenizer has no document delimiter to "
                             "stand for it")
        ids = [start]
    return ids


def pair_ids(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The ids of a (context, continuation) request of lm-evaluation-harness: spaces that end the context move
    to the continuation (the harness's own adapters do so), so a context "Q:" + " A" and "Q: " + "A" read alike."""
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    return context_ids(tokenizer, stripped), tokenizer.encode(continuation)


def harness_task(path: str) -> dict:
    """The lm-evaluation-harness task config of a local JSONL task in this format: the same examples, choices
    and delimiter as the training loop's, its acc the same rule; the data read from the file, no network."""
    return {"task": task_name(path), "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"validation": os.path.abspath(path)}},
            "output_type": "multiple_choice", "validation_split": "validation", "target_delimiter": DELIMITER,
            "doc_to_text": "{{ctx}}", "doc_to_choice": "{{endings}}", "doc_to_target": "{{label}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0}}
