"""Parallel layout maths, in one place: world = dp x pp, and the batch triple.

DeepSpeed requires train_batch_size == micro_batch x grad_accum x dp but its error names the world
size; with pipelines dp = world / stages, so we derive and check the triple ourselves first.
"""
from dataclasses import dataclass

from training.config import ConfigError

MICRO = "train_micro_batch_size_per_gpu"
ACCUM = "gradient_accumulation_steps"
GLOBAL = "train_batch_size"


@dataclass(frozen=True)
class Layout:
    world_size: int
    pipeline_stages: int
    micro_batch: int
    grad_accum: int

    @property
    def dp(self) -> int:
        return self.world_size // self.pipeline_stages

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def describe(self) -> str:
        return (f"world {self.world_size} = dp {self.dp} x pp {self.pipeline_stages}; global batch "
                f"{self.global_batch} = micro {self.micro_batch} x accum {self.grad_accum} x dp {self.dp}")


def resolve_layout(ds: dict, world_size: int, pipeline_stages: int = 1) -> Layout:
    """Derive the missing member of the batch triple in `ds` (in place) and check that it holds."""
    if world_size % pipeline_stages:
        raise ConfigError(f"{pipeline_stages} pipeline stages do not divide the world size {world_size}: "
                          f"launch a multiple of {pipeline_stages} processes or change pipeline.stages")
    dp = world_size // pipeline_stages
    micro, accum, batch = ds.get(MICRO), ds.get(ACCUM), ds.get(GLOBAL)
    for key, value in ((MICRO, micro), (ACCUM, accum), (GLOBAL, batch)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    if micro is None and batch is None:
        raise ConfigError(f"the ds_config sets neither {MICRO} nor {GLOBAL}: set at least one")
    if batch is None:
        accum = accum or 1
        batch = micro * accum * dp
    elif micro is None:
        accum = accum or 1
        if batch % (accum * dp):
            raise ConfigError(f"{GLOBAL}={batch} is not divisible by {ACCUM} ({accum}) x dp ({dp}, "
                              f"= world {world_size} / pp {pipeline_stages}): no whole micro batch fits")
        micro = batch // (accum * dp)
    elif accum is None:
        if batch % (micro * dp):
            raise ConfigError(f"{GLOBAL}={batch} is not divisible by {MICRO} ({micro}) x dp ({dp}, "
                              f"= world {world_size} / pp {pipeline_stages}): no whole number of "
                              f"accumulation steps fits")
        accum = batch // (micro * dp)
    if batch != micro * accum * dp:
        raise ConfigError(
            f"{GLOBAL} ({batch}) != {MICRO} ({micro}) x {ACCUM} ({accum}) x dp ({dp}, = world "
            f"{world_size} / pp {pipeline_stages}) = {micro * accum * dp}. Fix one of them, or drop "
            f"{GLOBAL} from the ds_config and it is derived.")
    ds.update({MICRO: micro, ACCUM: accum, GLOBAL: batch})
    return Layout(world_size, pipeline_stages, micro, accum)
