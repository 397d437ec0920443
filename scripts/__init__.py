"""The commands a person runs, each a thin main over the library (training/, data/, model/): `python -m scripts.NAME`
from the repo's root. train.py, sample.py and preflight.py stay at the top, `python -m data.prepare` in data/."""
