"""Rewards for the online-RL tests, named as a user names theirs (rl.reward=rl_rewards:NAME; tests/ is on the path
of the ranks the tests start): a graded one that a model of random weights already spreads (the answer's length),
and two that break the rules."""


def length(record: dict, completion: str) -> float:
    return len(completion) / 10


def raises(record: dict, completion: str) -> float:
    return {"a": 1}[completion]


def text(record: dict, completion: str):
    return "high"
