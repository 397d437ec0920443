"""Rewards for the online-RL tests, named as a user names theirs (rl.reward=rl_rewards:NAME; tests/ is on the path
of the ranks the tests start): a graded one that a model of random weights already spreads (the answer's length),
two that break the rules, and a reward model's score computed by hand."""


def length(record: dict, completion: str) -> float:
    return len(completion) / 10


def raises(record: dict, completion: str) -> float:
    return {"a": 1}[completion]


def text(record: dict, completion: str):
    return "high"


_MODELS = {}


def model_score(record: dict, completion: str) -> float:
    """The score of the reward model at $RL_REWARD_MODEL, computed as a user would with training/reward_model.py."""
    import os

    from training.reward_model import load_reward_model
    folder = os.environ["RL_REWARD_MODEL"]
    model = _MODELS.setdefault(folder, load_reward_model(folder))
    return float(model.score([model.encode(record["prompt"], [{"role": "assistant", "content": completion}])])[0])
