"""What the training loop asks of an objective: everything it does differently for one. train.py calls these and
nothing else of an objective, so a new one (a reward model's, online RL's) is a new module and one line in the
registry (training/objectives/__init__.py), with no change to the loop.

`run` is the run's record (training/startup.py Run) and `rank` this process once its engine is built (train.py
Rank): an objective reads what it needs of them (the data, the layout, the engine's driver)."""


class Objective:
    """The base: a step's loss is the objective's own, everything else does nothing. Subclasses override."""

    name = "objective"
    head = "lm"  # the model.head it trains (model/config.py HEADS): choose_objective refuses a model of another

    def describe(self) -> str | None:
        """Its start-up line (its settings), or None where it needs no words."""
        return None

    def prepare(self, run, rank) -> str | None:
        """Collective, once the engine holds the starting weights and before step 1: what the objective needs
        computed first (a reference's log-probabilities); returns a line to print, or None."""
        return None

    def step_batches(self, step: int, micro_batches: list, driver) -> list:
        """Collective: the micro-batches the engine trains step `step` on, made from the data's (this rank's
        share; [] on a pipeline stage that reads no data): the data's own, or what the objective makes of them
        (online RL's rollouts of their prompts)."""
        return micro_batches

    def step_loss(self, micro_batches: list, driver):
        """The loss function of the step of `micro_batches`, called by the engine as loss_fn(logits, labels)."""
        raise NotImplementedError

    def progress(self, driver) -> tuple[dict, str]:
        """Collective: figures of the steps since the last call beside the loss (means, for metrics.jsonl), and
        their text in the progress line (" | ..." or "")."""
        return {}, ""

    def evaluate(self, run, rank, split: str, windows: int) -> dict:
        """Collective: the loss of `split`'s fixed validation windows ("loss") and any figures beside it."""
        raise NotImplementedError

    def evaluation_text(self, figures: dict) -> str:
        """The evaluation line's words for the figures of both splits ("train_<name>", "val_<name>")."""
        return ""

    def record(self) -> dict:
        """What a checkpoint keeps of it (run_state.json), read back by `build` as `saved` when a run resumes."""
        return {}

