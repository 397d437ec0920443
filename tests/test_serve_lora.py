"""`python -m scripts.serve --lora_modules` over a chat model's export: a LoRA run of train.py from that export is
served beside it as a model of its own name, answering as sample.py answers from the run (its adapters merged);
requests of the model and of the adapter decode together as each alone; vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter add the run's adapter export and take it away while the server runs, each mistake a 4xx
naming it; an adapter of another model is refused at start in one line."""
import sys

import httpx
import pytest

from harness import FP32, free_port, launch, run
from servers import MESSAGE, Server, at_once, chat_model_export, metric, wait_for

pytestmark = pytest.mark.launch  # train.py and a server process

CONTEXT = 64
LORA = ["model.arch=llama", "model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=32",
        "model.ffn_hidden=64", f"model.block_size={CONTEXT}", "model.lora_rank=4", "model.lora_alpha=8",
        "train.max_steps=4", "train.save_interval=4", "train.eval_interval=4", "optim.warmup_steps=1", "optim.lr=3e-2",
        "data.pack=false", "ds.train_micro_batch_size_per_gpu=4", "ds.gradient_accumulation_steps=1", *FP32]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """The chat model's export, and a LoRA run fine-tuned from it on its conversations."""
    folder = tmp_path_factory.mktemp("serve_lora")
    base = chat_model_export(folder, block_size=CONTEXT)
    launch(1, "zero0.json", folder / "run", str(folder / "data"), [*LORA, f"train.init_from={base}"],
           config="llama_quickstart.yaml")
    return {"base": base, "run": str(folder / "run")}


@pytest.fixture(scope="module")
def server(folders):
    served = Server(folders["base"], "--lora_modules", f"tuned={folders['run']}")
    yield served
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output


def answer(server, model: str, message: str = MESSAGE, **options) -> str:
    reply = server.client().chat.completions.create(model=model, messages=[{"role": "user", "content": message}],
                                                    temperature=0, max_tokens=16, **options)
    assert reply.model == model
    return reply.choices[0].message.content


def test_models_lists_the_model_then_its_adapters(server, folders):
    listed = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(m["id"], m.get("parent"), m.get("root")) for m in listed] == \
        [("export", None, None), ("tuned", "export", folders["run"])]


def test_the_adapter_answers_as_sample_py_from_its_run(server, folders):
    sampled = run([sys.executable, "sample.py", "--out_dir", folders["run"], "--chat", MESSAGE, "--temperature", "0",
                   "--max_new_tokens", "16"]).stdout[:-1]  # print's newline
    assert answer(server, "tuned") == sampled
    assert answer(server, "export") != sampled  # the adapters count


def test_the_model_and_the_adapter_decode_together_as_each_alone(server):
    asked = [(model, f"Reverse: {words}") for model, words in
             (("tuned", "king crown"), ("export", "king crown"), ("tuned", "night king night"), ("export", "crown"))]
    alone = [answer(server, model, message) for model, message in asked]

    def stream(model, message):
        chunks = server.client().chat.completions.create(
            model=model, messages=[{"role": "user", "content": message}], temperature=0, max_tokens=16, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    def finished() -> dict:
        return {model: metric(server, f'megalite_model_requests_total{{model="{model}"}}') for model in
                ("tuned", "export")}

    before = finished()
    assert at_once([lambda a=a: stream(*a) for a in asked]) == alone
    # counted on the model's thread just after each stream's end
    wait_for(lambda: {model: count - before[model] for model, count in finished().items()} == {"tuned": 2, "export": 2},
             "two requests of each model counted")


def test_adapters_load_and_unload_while_serving(server, folders):
    exported = run([sys.executable, "-m", "scripts.export", "--out_dir", folders["run"], "--adapter"]).stdout
    folder = exported.split("wrote ")[1].split(":")[0]

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)

    loaded = post("load_lora_adapter", {"lora_name": "again", "lora_path": folder})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'again' added successfully.")
    assert answer(server, "again") == answer(server, "tuned")
    for body, status, message in [
            ({"lora_name": "again", "lora_path": folder}, 400, "the lora adapter 'again' has already been loaded"),
            ({"lora_name": "export", "lora_path": folder}, 400, "lora_name 'export' is the served model's name"),
            ({"lora_name": "other", "lora_path": folders["base"]}, 400, f"lora_path {folders['base']}: an export of "
                                                                        f"whole weights, not adapters"),
            ({"lora_name": "other", "lora_path": f"{folder}_gone"}, 400, f"lora_path {folder}_gone: no such folder")]:
        refused = post("load_lora_adapter", body)
        assert refused.status_code == status and refused.json()["error"]["message"].startswith(message), refused.text
    assert post("unload_lora_adapter", {"lora_name": "again"}).status_code == 200
    gone = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": "again", "messages": [{"role": "user", "content": MESSAGE}]})
    assert gone.status_code == 404 and gone.json()["error"]["message"].startswith("the model 'again' is not served")
    missing = post("unload_lora_adapter", {"lora_name": "again"})
    assert missing.status_code == 404 and "'again' cannot be found" in missing.json()["error"]["message"]
    assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["export", "tuned"]


def test_start_refuses_an_adapter_that_is_no_adapter_in_one_line(folders):
    started = run([sys.executable, "-m", "scripts.serve", "--export", folders["base"], "--port", str(free_port()),
                   "--lora_modules", f"whole={folders['base']}"], check=False)
    assert started.returncode == 2 and "Traceback" not in started.stderr
    assert started.stderr.strip() == f"error: --lora_modules: lora_path {folders['base']}: an export of whole " \
        f"weights, not adapters; fix: load it with /v1/load_weights, or name the run's adapters (python -m " \
        f"scripts.export --adapter)"



def test_the_chat_page_chats_with_the_adapter_chosen(server, browser):
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get(f"{server.url}/")
    chooser = WebDriverWait(browser, 30).until(lambda b: Select(b.find_element("id", "model")) if len(
        Select(b.find_element("id", "model")).options) == 2 else None)
    assert [o.text for o in chooser.options] == ["export", "tuned"] and chooser.first_selected_option.text == "export"
    chooser.select_by_visible_text("tuned")
    browser.find_element("id", "message").send_keys(MESSAGE)
    browser.find_element("id", "go").click()
    WebDriverWait(browser, 60).until(lambda b: b.find_elements("css selector", "[data-done=true]"))
    shown = browser.find_elements("css selector", "#log .assistant")[-1].get_attribute("textContent")
    api = server.client().chat.completions.create(model="tuned", messages=[{"role": "user", "content": MESSAGE}],
                                                  temperature=0)
    assert shown == api.choices[0].message.content and shown
    assert Select(browser.find_element("id", "model")).first_selected_option.text == "tuned"  # kept
