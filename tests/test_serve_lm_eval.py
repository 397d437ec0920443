"""lm-evaluation-harness scores a served model as users score any server (its `local-completions` model, which
finds the server's tokenizer through vLLM's /tokenizer_info, /tokenize and /detokenize): on the Shakespeare
continuation task (HellaSwag's format) each request's log-likelihood and greediness equal those the harness gets
in process from the same export (training/evaluation/lm_eval_model.py, 1e-4), and acc and acc_norm equal
`python -m scripts.evaluate`'s."""
import json

import pytest

from data.tasks import DELIMITER, harness_task
from model.config import ModelConfig
from model_checks import decisive_model
from scripts import evaluate
from servers import Server
from training.checkpoints.export import load_trained, write_export
from training.evaluation.lm_eval_model import CheckpointLM

pytestmark = pytest.mark.launch  # a server process (python -m pytest -m "not launch" skips it)

EXAMPLES = 24
BLOCK = 1024  # the task's longest context and ending fit: both score the same window


class Request:
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def export(tmp_path_factory, char_data) -> str:
    with open(f"{char_data}/meta.json") as f:
        meta = json.load(f)
    cfg = ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=BLOCK,
                      vocab_size=meta["vocab_size"])
    model = decisive_model(cfg, seed=1)  # no near ties between the harness's two paths
    return write_export(str(tmp_path_factory.mktemp("lm_eval") / "export"), cfg, model.state_dict(), meta, step=0,
                        data_dir=char_data)


def test_the_harness_scores_the_served_model_as_it_scores_the_export_in_process(export, shakespeare_task, tmp_path):
    evaluate.go_offline()
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    server = Server(export)
    try:
        served = LocalCompletionsAPI(model="export", base_url=f"{server.url}/v1/completions", max_length=BLOCK,
                                     num_concurrent=1, max_retries=1)
        assert served.tokenizer_backend == "remote"  # found the server's tokenizer by itself
        with open(shakespeare_task) as f:
            records = [json.loads(line) for line, _ in zip(f, range(4))]
        requests = [Request(r["ctx"], DELIMITER + ending) for r in records for ending in r["endings"]]
        cfg, model, tokenizer, _ = load_trained(None, None, export)
        in_process = CheckpointLM(model, cfg.block_size, cfg.vocab_size, tokenizer, "cpu").loglikelihood(requests)
        over_http = served.loglikelihood(requests)
        assert [greedy for _, greedy in over_http] == [greedy for _, greedy in in_process]
        assert all(abs(a - b) < 1e-4 for (a, _), (b, _) in zip(over_http, in_process)), (over_http, in_process)
        results = lm_eval.simple_evaluate(model=served, tasks=[harness_task(shakespeare_task)], limit=EXAMPLES,
                                          log_samples=False, bootstrap_iters=0)["results"]
    finally:
        code, output = server.stop()
    assert code == 0 and "Traceback" not in output, output
    evaluate.main(["--export", export, "--tasks", shakespeare_task, "--limit", str(EXAMPLES), "--output",
                   str(tmp_path / "in_process.json")])
    scored = json.loads((tmp_path / "in_process.json").read_text())["tasks"]["shakespeare"]["metrics"]
    over = next(iter(results.values()))
    assert (over["acc,none"], over["acc_norm,none"]) == (scored["acc,none"], scored["acc_norm,none"])
