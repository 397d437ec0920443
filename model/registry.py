"""model.arch -> its Architecture (model/architecture.py). A new architecture is one more entry here."""
from common.checks import ConfigError
from model.architecture import Architecture
from model.config import ModelConfig
from model.encoder import ENCODER
from model.gpt import GPT
from model.llama import LLAMA
from model.lora import check_targets, linear_maps

ARCHITECTURES = {a.name: a for a in (GPT, LLAMA, ENCODER)}
# Settings of the attention that only some architectures compute (each an entry of the others' `unsupported`),
# at the value that asks for nothing.
ATTENTION_OPTIONS = {"head_dim": None, "qkv_bias": False, "qk_norm": False}
OFF = {None: "null", False: "false"}


def architecture(cfg: ModelConfig) -> Architecture:
    if cfg.arch not in ARCHITECTURES:
        raise ConfigError(f"model.arch={cfg.arch!r}: must be one of {', '.join(ARCHITECTURES)}; fix: set model.arch "
                          f"to one of them")
    return ARCHITECTURES[cfg.arch]


def check_architecture(cfg: ModelConfig, c) -> None:
    """The model settings' checks that depend on the architecture (c: common.checks.Checks), after ModelConfig's."""
    c.one_of("arch", tuple(ARCHITECTURES))
    arch = ARCHITECTURES[cfg.arch]
    arch.check(cfg, c)
    c.that(arch.supports("document_masking") or not cfg.document_masking, "document_masking",
           f"be false for {arch.title} ({arch.unsupported.get('document_masking')})",
           f"set model.document_masking=false, or train {supporting('document_masking')}")
    c.that(arch.supports("mixture_of_experts") or not cfg.n_experts, "n_experts",
           f"be 0 for {arch.title} ({arch.unsupported.get('mixture_of_experts')})",
           f"set model.n_experts=0, or train {supporting('mixture_of_experts')}")
    c.that(arch.supports("lora") or not cfg.lora_rank, "lora_rank",
           f"be 0 for {arch.title} ({arch.unsupported.get('lora')})",
           f"set model.lora_rank=0, or train {supporting('lora')}")
    if arch.supports("lora"):
        check_targets(cfg, linear_maps(arch.plan, arch.block), arch.title, c)
    for setting, off in ATTENTION_OPTIONS.items():
        c.that(arch.supports(setting) or getattr(cfg, setting) == off, setting,
               f"be {OFF[off]} for {arch.title} ({arch.unsupported.get(setting)})",
               f"remove model.{setting}, or train {supporting(setting)}")


def read_settings(settings: dict) -> dict:
    """Model settings (a ModelConfig's, as a dict) less those its architecture never reads (Architecture.ignores):
    what two models are compared on."""
    ignored = ARCHITECTURES[settings["arch"]].ignores if settings["arch"] in ARCHITECTURES else ()
    return {k: v for k, v in settings.items() if k not in ignored}


def supporting(feature: str) -> str:
    """The architectures that have a feature, as a message names them: "the GPT or the Llama"."""
    return " or ".join(a.title for a in ARCHITECTURES.values() if a.supports(feature))
