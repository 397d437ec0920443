"""The chat page in headless Chromium against a server slowed to a larger model's pace (tests/fault_serve.py): a
system turn given on the page goes first in every request, the answer the API's for that conversation; Stop ends an
answer mid-stream, keeps what came as the assistant's turn (sent with the next message) and the server frees the
sequence's slot. A thinking model's reasoning shows in a folded block above its answer."""
import pytest

from servers import MESSAGE, Server, chat_model_export, metric, template_export, wait_for

pytestmark = pytest.mark.launch  # a server process and a browser
SYSTEM = "Reverse words."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Server(chat_model_export(tmp_path_factory.mktemp("page"), block_size=256, system=SYSTEM),
                    script=("tests/fault_serve.py",), env={"MEGALITE_SERVE_STEP_S": "0.1"})
    yield served
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output


def open_page(browser, server):
    """The page, its requests to /v1/chat/completions recorded in window.sent."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{server.url}/")
    WebDriverWait(browser, 30).until(lambda b: b.find_element("id", "model").text == "export")
    browser.execute_script("""window.sent = []; const fetched = window.fetch;
        window.fetch = (path, options) => {
            if (path === '/v1/chat/completions') window.sent.push(JSON.parse(options.body));
            return fetched(path, options);
        };""")


def ask(browser, message: str):
    """The message sent; a wait of a minute for what follows."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.find_element("id", "message").send_keys(message)
    browser.find_element("id", "go").click()
    return WebDriverWait(browser, 60)


def done(browser) -> int:
    """The answers finished (streamed to their end, stopped, or refused)."""
    return len(browser.find_elements("css selector", "[data-done=true]"))


def test_the_system_turn_goes_first_and_the_answer_is_the_apis(server, browser):
    open_page(browser, server)
    browser.find_element("id", "system").send_keys(SYSTEM)
    browser.find_element("id", "max_tokens").send_keys("12")
    ask(browser, MESSAGE).until(lambda b: done(b) == 1)
    shown = browser.find_elements("css selector", "#log .assistant")[-1].get_attribute("textContent")
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": MESSAGE}]
    assert browser.execute_script("return window.sent")[-1]["messages"] == conversation
    api = server.client().chat.completions.create(model="export", messages=conversation, temperature=0, max_tokens=12)
    assert shown == api.choices[0].message.content and shown


def test_stop_ends_the_answer_keeps_it_and_frees_the_slot(server, browser):
    open_page(browser, server)
    cancelled = metric(server, 'megalite_requests_total{reason="cancelled"}')
    wait = ask(browser, MESSAGE)
    wait.until(lambda b: b.find_elements("css selector", "#log .assistant")[-1].get_attribute("textContent"))
    assert browser.find_element("id", "go").get_property("disabled")
    browser.find_element("id", "stop").click()
    wait.until(lambda b: done(b) == 1)
    answer = browser.find_elements("css selector", "#log .assistant")[-1]
    stopped = answer.get_attribute("textContent")
    assert answer.get_attribute("data-stopped") == "true" and stopped
    assert not browser.find_element("id", "go").get_property("disabled")
    assert browser.find_element("id", "stop").get_property("disabled")
    wait_for(lambda: metric(server, 'megalite_requests_total{reason="cancelled"}') == cancelled + 1, "cancelled")
    wait_for(lambda: metric(server, "megalite_slots_in_use") == 0, "the slot freed")
    full = server.client().chat.completions.create(model="export", messages=[{"role": "user", "content": MESSAGE}],
                                                   temperature=0, max_tokens=len(stopped) + 20)
    assert full.choices[0].message.content.startswith(stopped) and full.choices[0].message.content != stopped
    browser.find_element("id", "max_tokens").send_keys("4")
    ask(browser, "Reverse: king").until(lambda b: done(b) == 2)
    assert browser.execute_script("return window.sent")[-1]["messages"] == [
        {"role": "user", "content": MESSAGE}, {"role": "assistant", "content": stopped},
        {"role": "user", "content": "Reverse: king"}]


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """A model whose template opens a <think> in the prompt (DeepSeek-R1's): all it writes is reasoning until it
    writes </think>, which a random model does not."""
    from test_serve_reasoning import TEMPLATE

    opened = TEMPLATE.replace("{% if add_generation_prompt %}Assistant: ", "{% if add_generation_prompt %}Assistant: "
                              "<think>", 1)
    served = Server(template_export(tmp_path_factory.mktemp("thinking_page"), opened, block_size=256))
    yield served
    code, output = served.stop()
    assert code == 0 and "Traceback" not in output, output


def test_a_thinking_models_reasoning_shows_folded_above_its_answer(thinking_server, browser):
    open_page(browser, thinking_server)
    browser.find_element("id", "max_tokens").send_keys("12")
    ask(browser, MESSAGE).until(lambda b: done(b) == 1)
    thought = browser.find_element("css selector", "#log details.thinking span").get_attribute("textContent")
    api = thinking_server.client().chat.completions.create(model="export", messages=[
        {"role": "user", "content": MESSAGE}], temperature=0, max_tokens=12).choices[0].message
    assert thought == api.reasoning_content and thought and api.content is None
    assert browser.find_elements("css selector", "#log .assistant")[-1].get_attribute("textContent") == ""
