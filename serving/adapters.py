"""The LoRA adapters a server holds beside its model, by the name a request gives as its `model` (vLLM's
--lora-modules, /v1/load_lora_adapter and /v1/unload_lora_adapter): each read from a folder in PEFT's layout
(`python -m scripts.export --adapter`'s, or PEFT's own save_pretrained over the Hugging Face model the server's
export is) or from a LoRA run's out_dir (its checkpoint's adapters), checked against the served model, and run
per sequence by model/lora_batch.py. A run's adapters bring their chat template (a base model fine-tuned on
conversations through adapters is chatted with in the fine-tune's template); a PEFT folder's use the served model's.

A request of an adapter holds the adapter it was admitted with: unloading one stops new requests naming it, and
those already in run to their end."""
import argparse
import math
import os
import re

from common.checks import ConfigError, json_file
from model import architecture
from model.config import ModelConfig
from model.lora import linear_maps
from model.lora_batch import Adapter, BatchAdapters
from training.checkpoints import checkpoint
from training.checkpoints.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_adapter
from training.checkpoints.export import consolidated_state_dict, read_weights, run_dataset, run_model
from training.checkpoints.hf import tensor_pairs

TENSOR = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
# PEFT's settings whose adapters compute something else than x A^T B^T alpha / r on the maps named: refused where set
UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "modules_to_save": "modules trained whole",
               "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
               "layer_replication": "replicated layers", "trainable_token_indices": "trained token embeddings"}


class Adapters:
    def __init__(self, served: str, cfg: ModelConfig, meta: dict, batch: BatchAdapters, check_model):
        """served: the base model's name; check_model(path, cfg, meta, chat): raises where a run trained another
        model than the served one (serving/weights.py's check)."""
        self.served, self.cfg, self.meta, self.batch, self.check_model = served, cfg, meta, batch, check_model
        self.by_name: dict[str, Adapter] = {}
        self.metas: dict[Adapter, dict] = {}  # the dataset meta (its chat template) a run's adapters were tuned on
        self._pairs = None

    def meta_of(self, adapter: Adapter | None) -> dict:
        """The meta whose chat template renders the conversations of the adapter's requests (None: the base's)."""
        return self.metas.get(adapter, self.meta)

    def read(self, name, path, tag=None) -> Adapter:
        """The adapter at `path` (a run's: its checkpoint `tag`, or its newest) under `name`, on the model's device and
        its maps hooked (on the model's thread, between two steps); a ConfigError says why it cannot be served."""
        self.check_name(name)
        if not isinstance(path, str) or not path or not os.path.isdir(path):
            raise ConfigError(f"lora_path {path}: no such folder on the server's machine; fix: name a folder of "
                              f"python -m scripts.export --adapter (PEFT's layout) or a LoRA run's out_dir")
        if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
            if tag is not None:
                raise ConfigError(f"lora_path {path}: an adapter folder, whose tag has no meaning (a tag names a "
                                  f"checkpoint of a run's out_dir); fix: leave tag out")
            config = json_file(os.path.join(path, ADAPTER_CONFIG), "adapter config", "save the adapter again")
            tensors = read_weights(os.path.join(path, ADAPTER_WEIGHTS), "adapter weights", "save the adapter again")
            return self.batch.prepare(self._adapter(name, path, config, tensors))
        if os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"lora_path {path}: an export of whole weights, not adapters; fix: load it with "
                              f"/v1/load_weights, or name the run's adapters (python -m scripts.export --adapter)")
        config, tensors, meta = self._run_adapter(path, tag)
        adapter = self.batch.prepare(self._adapter(name, path, config, tensors))
        self.metas[adapter] = meta
        return adapter

    def check_name(self, name) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError("lora_name must be a non-empty string: the model name its requests give")
        if name == self.served:
            raise ConfigError(f"lora_name {name!r} is the served model's name; fix: give the adapter its own")
        if name in self.by_name:
            raise ConfigError(f"the lora adapter {name!r} has already been loaded; fix: unload it first, or give "
                              f"this one another name")

    def add(self, adapter: Adapter) -> None:
        self.check_name(adapter.name)
        self.by_name[adapter.name] = adapter

    def remove(self, name) -> Adapter:
        """The adapter no new request may name (KeyError: none of that name); those admitted keep it."""
        adapter = self.by_name.pop(name)
        self.metas.pop(adapter, None)  # read as a request is, before it is admitted
        return adapter

    def _run_adapter(self, path: str, tag) -> tuple[dict, dict, dict]:
        """A LoRA run's adapters, as its adapter export would write them, and its dataset's meta."""
        tag_dir = checkpoint.find_checkpoint(path, tag)
        run_state = checkpoint.read_run_state(tag_dir)
        cfg = run_model(tag_dir, run_state)
        if not cfg.lora_rank:
            raise ConfigError(f"lora_path {path}: its run trained the whole model (model.lora_rank 0), no adapters; "
                              f"fix: load it with /v1/load_weights")
        meta = run_dataset(tag_dir, run_state)[0]
        self.check_model(path, cfg, meta, chat=False)
        return *peft_adapter(cfg, consolidated_state_dict(tag_dir), None), meta

    def _adapter(self, name: str, path: str, config: dict, tensors: dict) -> Adapter:
        """Each map's (A, B alpha / r) by the served model's module names, every tensor accounted for."""
        if config.get("peft_type") != "LORA":
            raise ConfigError(f"lora_path {path}: a {config.get('peft_type')} adapter; fix: serve a LoRA adapter")
        unsupported = [what for key, what in UNSUPPORTED.items() if config.get(key)] + \
            (["biases"] if config.get("bias", "none") != "none" else [])
        if unsupported:
            raise ConfigError(f"lora_path {path}: {', '.join(unsupported)} are not supported by this server; fix: "
                              f"merge the adapter into the weights and serve them")
        rank, alpha = config.get("r"), config.get("lora_alpha")
        if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
            raise ConfigError(f"lora_path {path}: {ADAPTER_CONFIG} needs r (at least 1) and lora_alpha")
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        ours, shapes, halves = self._our_names(), self.batch.shapes(), {}
        arch = architecture(self.cfg)
        targets = set(linear_maps(arch.plan, arch.block))  # what LoRA adapts: a block's maps, not its experts
        for key, tensor in tensors.items():
            found = TENSOR.fullmatch(key)
            module = ours.get(found.group(1)) if found else None
            if module not in shapes or module.partition(".")[2] not in targets:
                raise ConfigError(f"lora_path {path}: {key} adapts no linear map of the served model's blocks; fix: "
                                  f"serve adapters trained on this model")
            halves.setdefault(module, {})[found.group(2)] = tensor
        maps = {}
        for module, pair in halves.items():
            out, inner = shapes[module]
            a, b = pair.get("A"), pair.get("B")
            if a is None or b is None or a.shape != (rank, inner) or b.shape != (out, rank):
                got = [tuple(t.shape) if t is not None else None for t in (a, b)]
                raise ConfigError(f"lora_path {path}: {module}'s lora_A and lora_B are {got[0]} and {got[1]} where the "
                                  f"served model needs ({rank}, {inner}) and ({out}, {rank}); fix: serve adapters "
                                  f"trained on this model")
            maps[module] = (a.float(), b.float() * scale)
        if not maps:
            raise ConfigError(f"lora_path {path}: {ADAPTER_WEIGHTS} holds no adapters")
        return Adapter(name, maps, path)

    def _our_names(self) -> dict[str, str]:
        """Hugging Face's module names of the served model's maps, each to the model's own."""
        if self._pairs is None:
            self._pairs = {theirs.removesuffix(".weight"): ours.removesuffix(".weight")
                           for ours, theirs, _ in tensor_pairs(self.cfg) if theirs.endswith(".weight")}
        return self._pairs


def lora_module(entry: str) -> tuple[str, str]:
    """One of --lora_modules' NAME=PATH entries as (name, path) (an argparse type)."""
    name, sep, path = entry.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{entry!r} is not NAME=PATH (e.g. pirate=out/pirate_lora)")
    return name, path
