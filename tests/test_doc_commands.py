"""The command blocks of the docs a newcomer follows after the README (preference tuning, online RL, mixture of
experts, evaluation, serving a LoRA fine-tune), each run in order on a fresh clone where the README's quickstart has
run, as pasted, shortened and offline as tests/doc_commands.py makes them: a doc line that fails after the one before
it, or prints a traceback or known noise, turns the suite red. A block that needs a download or a GPU is marked in
its doc, and checked here as far as one machine can: its train.py settings load."""
import os
import re
import shlex

import pytest

from doc_commands import bash_blocks, check_in_order, train_settings
from harness import REPO, fresh_clone

DOCS = ["docs/preference.md", "docs/rl.md", "docs/moe.md", "docs/evaluation.md"]


@pytest.fixture(scope="module")
def after_quickstart(tmp_path_factory) -> tuple[str, set[str]]:
    """A fresh clone where the README's first command has run (data/shakespeare_char, out/quickstart), and the
    commands the docs have run in it."""
    clone = fresh_clone(tmp_path_factory.mktemp("newcomer"))
    check_in_order(bash_blocks("README.md", "Quickstart")[0][1][:1], clone)
    return clone, set()


@pytest.mark.launch
@pytest.mark.parametrize("doc", DOCS)
def test_a_docs_command_blocks_work_in_order_after_the_quickstart(after_quickstart, doc):
    """A command an earlier doc ran in the clone (rl.md's path to the fine-tuned model is preference.md's) is not run
    again: it would only find its output there, as other tests check (a second `python train.py` resumes and samples
    in the README's blocks; a second export, task or dataset says there is nothing to do). Run alone, a doc runs all
    its lines."""
    clone, ran = after_quickstart
    commands = [command for elsewhere, block in bash_blocks(doc) if elsewhere is None for command in block]
    assert commands, doc
    check_in_order([command for command in commands if command not in ran], clone)
    ran.update(commands)


@pytest.mark.launch
def test_serving_a_lora_fine_tune_works_after_the_readmes_fine_tuning(after_quickstart):
    """docs/serving.md's LoRA block after the README's fine-tuning lines it follows (run here where no doc ran them):
    the fine-tune's adapters trained and served by name beside the model they adapt."""
    clone, ran = after_quickstart
    readme = next(block for _, block in bash_blocks("README.md") if "python -m data.reverse_task" in block)
    lora = [block for _, block in bash_blocks("docs/serving.md") if any("--lora_modules" in c for c in block)]
    assert len(lora) == 1, lora
    commands = readme + lora[0]
    check_in_order([command for command in commands if command not in ran], clone)
    ran.update(commands)


def test_the_blocks_not_run_here_name_settings_that_load():
    elsewhere = [command for doc in DOCS for reason, block in bash_blocks(doc) if reason for command in block]
    assert len(elsewhere) >= 2, elsewhere
    for argv in map(shlex.split, elsewhere):
        if "train.py" in argv:
            train_settings(argv)
        else:
            assert argv[:3] == ["python", "-m", "scripts.evaluate"], argv
            from scripts.evaluate import parse_args as evaluate_args
            evaluate_args(argv[3:])


def test_the_shipped_task_yaml_is_the_one_the_docs_show():
    with open(os.path.join(REPO, "docs", "evaluation.md")) as f:
        shown = re.search(r"```yaml\n(.*?)```", f.read(), re.S).group(1)
    with open(os.path.join(REPO, "configs", "eval", "shakespeare.yaml")) as f:
        assert f.read() == shown
