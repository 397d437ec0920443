"""What a benchmark or a watch sees of the training loop without changing it: train.main(argv, observers=[...])
calls each observer's methods at their points, on every rank, in the loop's own thread. The base sees nothing;
subclass and override what you need (benchmarks/gpu_watch.py times the steps, benchmarks/tensor_parallel.py and
sequence_parallel.py count each step's communication)."""


class Observer:
    def before_step(self, step: int, driver, micro_batches: list) -> None:
        """Right before the step's forward, backward and optimizer step (`driver`: training/engines.py)."""

    def after_step(self, step: int, driver, loss) -> None:
        """Right after them: `loss` is the step's mean loss, still on the device."""

    def before_log(self, run, step: int) -> None:
        """Before a progress line reads its interval's loss, time and memory."""

    def after_log(self, run, step: int) -> None:
        """After the progress line is written."""


class Observers(Observer):
    """Several observers as one, called in their order."""

    def __init__(self, observers=()):
        self.observers = list(observers)

    def before_step(self, *args) -> None:
        for observer in self.observers:
            observer.before_step(*args)

    def after_step(self, *args) -> None:
        for observer in self.observers:
            observer.after_step(*args)

    def before_log(self, *args) -> None:
        for observer in self.observers:
            observer.before_log(*args)

    def after_log(self, *args) -> None:
        for observer in self.observers:
            observer.after_log(*args)
