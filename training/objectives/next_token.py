"""The language-model objective: each target token's cross-entropy, meaned over a step's target tokens (text) or,
for conversations, over the global batch's supervised tokens, so that a short answer weighs as its tokens do
whatever the layout (training/steps.py supervised_share)."""
import functools

from common.checks import ConfigError
from training.objectives.base import Objective
from training.steps import lm_loss, supervised_share


class NextToken(Objective):
    name = "next_token"

    def __init__(self, supervised: bool = False, compiled: bool = False):
        self.supervised, self.compiled = supervised, compiled  # compiled: train.compile's fused loss

    def step_loss(self, micro_batches: list, driver):
        divisor = None
        if self.supervised:
            divisor = supervised_share(micro_batches, driver.data_parallel_group, driver.engine.dp_world_size)
        return functools.partial(lm_loss, tp=driver.tp, divisor=divisor, compiled=self.compiled)

    def evaluate(self, run, rank, split: str, windows: int) -> dict:
        batches = [rank.sp.split(*batch) for batch in run.data.eval_batches(split, windows, rank.dp_rank, run.layout,
                                                                            run.device)]
        return {"loss": rank.driver.eval_loss(batches, run.data.eval_targets(split, windows))}


def build(name: str, cfg, data, layout, init_from: str | None, saved: dict | None) -> NextToken:
    if data.KIND == "preference":
        raise ConfigError(f"train.objective={name} trains on text or conversations, but {cfg.data.dir} holds "
                          f"preference pairs; fix: set train.objective to dpo, ipo or simpo (or leave it unset)")
    return NextToken(supervised=data.KIND == "conversations", compiled=cfg.train.compile)


NEXT_TOKEN = NextToken()  # the engines' default, for callers that train text outside a run (benchmarks)
