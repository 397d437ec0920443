"""Tool use end to end: a tiny Llama fine-tuned (train.py, one process) on conversations of tool use prepared with the
built-in hermes template is served, and the official client's agent loop goes round: asked about a city's weather
with the tool given (tool_choice auto), the model calls it with that city, and given the tool's answer, answers in
text from it."""
import itertools
import json

import pytest

from chats import write_jsonl
from data.prepare_chat import prepare_chat
from harness import FP32, train_py
from servers import Server

pytestmark = pytest.mark.launch  # a training run and a server
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITIES, SKIES = ("Rome", "Oslo", "Lima", "Pune"), ("rain", "sun", "snow")


def tool_use(city: str, sky: str) -> dict:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    return {"tools": [WEATHER], "messages": [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": sky},
        {"role": "assistant", "content": f"{sky.capitalize()} in {city}."}]}


def test_a_model_fine_tuned_on_tool_use_calls_the_tool_and_answers_from_its_result(tmp_path):
    records = [tool_use(city, sky) for city, sky in itertools.product(CITIES, SKIES)] * 20
    prepare_chat([write_jsonl(tmp_path / "tools.jsonl", records)], str(tmp_path / "data"), "char", "hermes",
                 context=384, val_fraction=0.2)
    train_py(["--config", "configs/llama_quickstart_sft.yaml", f"data.dir={tmp_path / 'data'}",
              f"train.out_dir={tmp_path / 'run'}", "model.n_layer=2", "model.n_embd=64", "model.ffn_hidden=128",
              "model.block_size=384", "train.epochs=null", "train.max_steps=400", "optim.lr=3e-3",
              "optim.min_lr=3e-4", "train.eval_interval=400", "train.eval_windows=4", "train.log_interval=50",
              "sample.chat='Weather in Rome?'", "sample.max_new_tokens=4", *FP32])
    server = Server(str(tmp_path / "run"), source="--out_dir")
    try:
        client = server.client()
        for city in CITIES:
            ask = [{"role": "user", "content": f"Weather in {city}?"}]
            called = client.chat.completions.create(model="run", messages=ask, tools=[WEATHER], temperature=0,
                                                    max_tokens=90).choices[0]
            assert called.finish_reason == "tool_calls", called
            (call,) = called.message.tool_calls
            assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": city}
            answered = client.chat.completions.create(model="run", tools=[WEATHER], temperature=0, max_tokens=20,
                                                      messages=[*ask, called.message.model_dump(exclude_none=True),
                                                                {"role": "tool", "tool_call_id": call.id,
                                                                 "content": "snow"}]).choices[0]
            assert answered.message.content == f"Snow in {city}." and not answered.message.tool_calls
    finally:
        code, output = server.stop()
    assert code == 0 and "Traceback" not in output, output
