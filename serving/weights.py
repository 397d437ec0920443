"""New weights for a running server (POST /v1/load_weights): an export, or a run's checkpoint of any layout, read
and checked on the model's thread between two steps (the same architecture and shape, the same tokenizer), then
copied into the served model between requests, the prefix cache emptied (it holds keys and values of the old
weights)."""
import dataclasses
import os

import torch

from common.checks import ConfigError
from data.documents import documents_seen
from model.registry import read_settings
from training.checkpoints.export import load_trained
from training.evaluation.evaluate import where

# Settings of training alone: weights trained with other values of these serve the same way. document_masking is
# compared as generation reads it (_documents): a dataset without a delimiter is one document either way.
TRAINING_ONLY = ("dropout", "router_aux_loss_coef", "router_z_loss_coef", "router_bias_rate", "document_masking")
TOKENIZER = ("tokenizer_fingerprint", "vocab_size", "stop_ids")  # what the API's encoding reads, and where answers end
# what its chat prompts read (not the data's statistics, nor where the template was read from: the same source read
# from two folders renders alike); no special tokens is none recorded (an earlier version's)
CHAT = ("chat_template", "special_tokens", "end_of_turn_id")


class Weights:
    def __init__(self, cfg, meta: dict, load, prefix_cache=None, dtype: torch.dtype = torch.float32):
        """load(state dict): puts weights into the served model (its load_state_dict, or model/onednn.py's);
        `dtype`: the served model's, at which new weights are read."""
        self.cfg, self.meta, self.load, self.prefix_cache, self.dtype = cfg, meta, load, prefix_cache, dtype

    def read(self, path, tag=None) -> tuple[dict, str, int]:
        """(the state dict, where it was read, its training step) of `path`: an export (a folder with config.json)
        or a run's out_dir (its checkpoint `tag`, or its newest). A ConfigError says why it cannot be served."""
        if not isinstance(path, str) or not path:
            raise ConfigError("path must name an export or a run's out_dir on the server's machine")
        if not os.path.isdir(path):
            raise ConfigError(f"path {path}: no such folder on the server's machine; fix: name an export or a "
                              f"run's out_dir")
        export = os.path.isfile(os.path.join(path, "config.json"))
        if tag is not None and (export or not isinstance(tag, str)):
            raise ConfigError("tag names a checkpoint of a run's out_dir (a string), not of an export")
        cfg, model, _, meta = load_trained(None if export else path, tag, path if export else None,  # a Hugging Face
                                           context=self.cfg.block_size, dtype=self.dtype)  # folder: at its context
        source, step, _ = where(None if export else path, tag, path if export else None, None)
        self.check_model(path, cfg, meta)
        return model.state_dict(), source, step

    def swap(self, state: dict) -> None:
        """On the scheduler's thread, no request running: the new weights in, the old keys and values out."""
        self.load(state)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def check_model(self, path: str, cfg, meta: dict, chat: bool = True) -> None:
        """A ConfigError where `cfg` and `meta` (of weights or adapters at `path`) are another model's than the served
        one: another architecture or shape, another tokenizer, or (`chat`) another chat template."""
        ours, theirs = _shape(self.cfg), _shape(cfg)
        if ours != theirs:
            differ = ", ".join(f"{k}={theirs[k]} (served: {ours[k]})" for k in ours if ours[k] != theirs[k])
            raise ConfigError(f"path {path}: another model ({differ}); fix: load weights of the served architecture "
                              f"and shape, or start a server for this one")
        theirs, ours = _documents(cfg, meta), _documents(self.cfg, self.meta)
        if theirs != ours:
            raise ConfigError(f"path {path}: trained to see documents begin {_told(theirs)}, where the served model "
                              f"sees them {_told(ours)}; fix: start a server for it")
        chats = [{k: m["chat"].get(k) or None for k in CHAT} if "chat" in m else None for m in (meta, self.meta)]
        if any(meta.get(k) != self.meta.get(k) for k in TOKENIZER) or (chat and chats[0] != chats[1]):
            raise ConfigError(f"path {path}: trained with another tokenizer{' or chat template' if chat else ''} than "
                              f"the served model's; fix: start a server for it")


def _documents(cfg, meta: dict) -> tuple | None:
    """Where generation sees a document begin (data/documents.py): (the delimiter, its id), None for nowhere."""
    seen = documents_seen(cfg.document_masking, meta)
    return None if seen is None else (seen.delimiter, seen.delimiter_id)


def _told(documents: tuple | None) -> str:
    return "nowhere (a window is one document)" if documents is None else f"at its {documents[0]} id {documents[1]}"


def _shape(cfg) -> dict:
    """The model settings that decide what weights compute (LoRA's: an adapted run's model is the one it adapts; none
    the architecture does not read)."""
    settings = read_settings(dataclasses.asdict(cfg))
    return {k: v for k, v in settings.items() if k not in TRAINING_ONLY and not k.startswith("lora_")}
