"""model.arch -> its Architecture (model/architecture.py). A new architecture is one more entry here."""
from common.checks import ConfigError
from model.architecture import Architecture
from model.config import ModelConfig
from model.encoder import ENCODER
from model.gpt import GPT
from model.llama import LLAMA

ARCHITECTURES = {a.name: a for a in (GPT, LLAMA, ENCODER)}


def architecture(cfg: ModelConfig) -> Architecture:
    if cfg.arch not in ARCHITECTURES:
        raise ConfigError(f"model.arch={cfg.arch!r}: must be one of {', '.join(ARCHITECTURES)}; fix: set model.arch "
                          f"to one of them")
    return ARCHITECTURES[cfg.arch]


def supporting(feature: str) -> str:
    """The architectures that have a feature, as a message names them: "the GPT or the Llama"."""
    return " or ".join(a.title for a in ARCHITECTURES.values() if a.supports(feature))
