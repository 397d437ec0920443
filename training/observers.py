"""What a benchmark or a watch sees of the training loop without changing it: train.main(argv, observers=[...])
calls each observer's methods at their points, on every rank, in the loop's own thread. The base sees nothing;
subclass and override what you need (benchmarks/gpu_watch.py times the steps, benchmarks/tensor_parallel.py and
sequence_parallel.py count each step's communication)."""


class Observer:
    def before_training(self, run, rank) -> None:
        """Once the engine holds its starting weights and the objective is prepared (`run`, `rank`: train.py's)."""

    def before_step(self, step: int, driver, micro_batches: list) -> None:
        """Right before the step's forward, backward and optimizer step (`driver`: training/engines.py)."""

    def after_step(self, step: int, driver, loss) -> None:
        """Right after them: `loss` is the step's mean loss, still on the device."""

    def before_log(self, run, step: int) -> None:
        """Before a progress line reads its interval's loss, time and memory."""

    def after_log(self, run, step: int) -> None:
        """After the progress line is written."""


class Observers(Observer):
    """Several observers as one, each told of an event in their order."""

    def __init__(self, observers=()):
        self.observers = list(observers)

    def _tell(self, event: str, *args) -> None:
        for observer in self.observers:
            getattr(observer, event)(*args)

    def before_training(self, *args) -> None:
        self._tell("before_training", *args)

    def before_step(self, *args) -> None:
        self._tell("before_step", *args)

    def after_step(self, *args) -> None:
        self._tell("after_step", *args)

    def before_log(self, *args) -> None:
        self._tell("before_log", *args)

    def after_log(self, *args) -> None:
        self._tell("after_log", *args)
