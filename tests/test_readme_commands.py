"""The README's command blocks, run in order on a fresh copy of the repo as a newcomer types them, each ending as
the README says (tests/doc_commands.py: shortened only by overrides where a command trains for minutes, and run
offline). What cannot run on one CPU machine (a cluster's hostfile, 8 GPUs' worth of a 124M model, GPT-2's BPE,
which tiktoken downloads) is in the README's second block, whose lines are checked by what they start (their
settings load and their refusal on a fresh clone names the fix), and tested for real elsewhere
(test_multinode.py, test_train.py)."""
import shlex

import pytest

from doc_commands import bash_blocks, check_in_order, train_settings
from harness import fresh_clone


def readme_commands(section: str, blocks: slice = slice(None)) -> list[str]:
    return sum((commands for _, commands in bash_blocks("README.md", section)[blocks]), [])


@pytest.mark.launch
def test_the_quickstart_running_and_configuration_blocks_work_in_order(tmp_path):
    commands = (readme_commands("Quickstart") + readme_commands("Running", blocks=slice(0, 1))
                + readme_commands("Configuration"))
    assert len(commands) >= 5, commands
    check_in_order(commands, fresh_clone(tmp_path))


def test_the_at_scale_block_names_settings_that_load_and_data_it_prepares():
    """What the second block of the Running section cannot run here is checked as far as one machine can: each
    train.py line's settings load and suit its layout, and its data is what the block (or the quickstart)
    prepares."""
    commands = readme_commands("Running", blocks=slice(1, 2))
    prepared = {"data/shakespeare_char"}  # the quickstart's
    prepared |= {argv[argv.index("--out_dir") + 1] for argv in map(shlex.split, commands)
                 if argv[:3] == ["python", "-m", "data.prepare"]}
    trains = [argv for argv in map(shlex.split, commands) if "train.py" in argv]
    assert len(trains) >= 3, commands
    for argv in trains:
        cfg = train_settings(argv)
        assert cfg.data.dir in prepared, f"{' '.join(argv)} trains on {cfg.data.dir}, which no command prepares"
