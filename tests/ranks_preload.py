"""What the rank server imports before it forks any rank (tests/ranks.py)."""
import deepspeed  # noqa: F401
import torch  # noqa: F401

import train  # noqa: F401
