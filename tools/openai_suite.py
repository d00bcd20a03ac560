#!/usr/bin/env python3
"""Drives `troupe serve` with the official `openai` Python client through
the parameters docs/serve.md lists, and prints one line per case: PASS,
or FAIL with what came back. Outside CI (it needs PyPI's openai); its log
is committed as tools/openai_suite.log.

  PYTHONPATH=... python3 tools/openai_suite.py http://127.0.0.1:8111/v1 sk-key

Each case either works (its result is checked, not only that it answered)
or gets the documented 4xx; nothing a client sets is silently ignored.
"""
import json
import re
import sys

import openai

BASE, KEY = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=60)
# vLLM's /tokenize and /detokenize are at the server's root, not under /v1.
root = openai.OpenAI(base_url=BASE.rsplit("/v1", 1)[0], api_key=KEY, max_retries=0, timeout=60)
MODEL = client.models.list().data[0].id
USER = [{"role": "user", "content": "Name a shape."}]
results = []


def case(name):
    def wrap(fn):
        try:
            fn()
            results.append((name, "PASS", ""))
        except AssertionError as e:
            results.append((name, "FAIL", str(e)))
        except Exception as e:  # an unexpected error is a failure too
            results.append((name, "FAIL", f"{type(e).__name__}: {e}"))
        return fn
    return wrap


def refused(status, param, **kwargs):
    """The request is refused with `status`, naming `param`."""
    endpoint = kwargs.pop("endpoint", "chat")
    try:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=USER, **kwargs)
        else:
            client.completions.create(model=MODEL, prompt="A red", **kwargs)
    except openai.APIStatusError as e:
        assert e.status_code == status, f"status {e.status_code}: {e}"
        body = e.body if isinstance(e.body, dict) else {}
        got = body.get("param") or (body.get("error") or {}).get("param")
        assert param is None or got == param, f"param {got!r}, wanted {param!r}: {e}"
        return
    raise AssertionError("accepted")


def chat(**kwargs):
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", USER),
                                          **kwargs)


@case("chat: temperature 0 is deterministic")
def _():
    a, b = chat(temperature=0, max_tokens=12), chat(temperature=0, max_tokens=12)
    assert a.choices[0].message.content == b.choices[0].message.content


@case("chat: seed reproduces a sampled answer")
def _():
    a = chat(temperature=1, seed=5, max_tokens=12).choices[0].message.content
    b = chat(temperature=1, seed=5, max_tokens=12).choices[0].message.content
    assert a == b, (a, b)


@case("chat: max_tokens and max_completion_tokens")
def _():
    assert chat(max_tokens=3, temperature=0, extra_body={"ignore_eos": True}).usage.completion_tokens == 3
    assert chat(max_completion_tokens=4, temperature=0,
                extra_body={"ignore_eos": True}).usage.completion_tokens == 4


@case("chat: stop strings never reach the client")
def _():
    full = chat(temperature=0, max_tokens=20).choices[0].message.content
    assert len(full) > 3
    cut = chat(temperature=0, max_tokens=20, stop=[full[2:4]]).choices[0].message.content
    assert full[2:4] not in cut and full.startswith(cut), (full, cut)


@case("chat: streaming with role chunk and usage")
def _():
    chunks = list(chat(stream=True, max_tokens=8, temperature=0,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens >= 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat(max_tokens=8, temperature=0).choices[0].message.content


@case("stream_options.continuous_usage_stats")
def _():
    chunks = list(chat(stream=True, max_tokens=6, temperature=0,
                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_usage = [c for c in chunks if c.choices and c.usage is not None]
    assert with_usage, "no chunk carried usage"


@case("n: several choices, choice i = seed + i")
def _():
    r = chat(n=3, temperature=1, seed=9, max_tokens=10)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = chat(temperature=1, seed=10, max_tokens=10).choices[0].message.content
    assert r.choices[1].message.content == alone


@case("logprobs and top_logprobs (chat)")
def _():
    r = chat(logprobs=True, top_logprobs=3, temperature=0, max_tokens=6)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    for t in lp:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert abs(t.logprob - t.top_logprobs[0].logprob) < 1e-6  # greedy: its own top


@case("logprobs (completions)")
def _():
    r = client.completions.create(model=MODEL, prompt="A red circle", max_tokens=5,
                                  temperature=0, logprobs=2)
    assert len(r.choices[0].logprobs.tokens) == len(r.choices[0].logprobs.token_logprobs)


@case("presence, frequency and repetition penalties change greedy output")
def _():
    base = chat(temperature=0, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].message.content
    for kw in ({"frequency_penalty": 2}, {"presence_penalty": 2}):
        other = chat(temperature=0, max_tokens=24, extra_body={"ignore_eos": True}, **kw)
        assert other.choices[0].message.content != base, kw
    rep = chat(temperature=0, max_tokens=24,
               extra_body={"ignore_eos": True, "repetition_penalty": 3})
    assert rep.choices[0].message.content != base


@case("logit_bias forces a token")
def _():
    r = client.completions.create(model=MODEL, prompt="A", max_tokens=4, temperature=0,
                                  logit_bias={"300": 100}, extra_body={"ignore_eos": True})
    one = client.completions.create(model=MODEL, prompt="A", max_tokens=1, temperature=0,
                                    logit_bias={"300": 100})
    assert r.choices[0].text == one.choices[0].text * 4


@case("min_tokens and stop_token_ids")
def _():
    r = client.completions.create(model=MODEL, prompt="A", max_tokens=10, temperature=0,
                                  logit_bias={"300": 100},
                                  extra_body={"stop_token_ids": [300], "min_tokens": 3})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"


@case("echo (completions)")
def _():
    r = client.completions.create(model=MODEL, prompt="A red", max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith("A red")


@case("token-id prompt (completions)")
def _():
    ids = root.post("/tokenize", body={"prompt": "A red circle"}, cast_to=object)["tokens"]
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    b = client.completions.create(model=MODEL, prompt="A red circle", max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text


@case("/tokenize and /detokenize")
def _():
    t = root.post("/tokenize", body={"prompt": "hello"}, cast_to=object)
    d = root.post("/detokenize", body={"tokens": t["tokens"]}, cast_to=object)
    assert t["count"] == len(t["tokens"]) and "hello" in d["prompt"]


@case("response_format json_schema")
def _():
    schema = {"type": "object", "properties": {"shape": {"enum": ["circle", "square"]},
              "n": {"type": "integer"}}, "required": ["shape", "n"], "additionalProperties": False}
    r = chat(temperature=0.8, seed=1, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}})
    if r.choices[0].finish_reason == "stop":
        v = json.loads(r.choices[0].message.content)
        assert v["shape"] in ("circle", "square") and isinstance(v["n"], int), v


@case("response_format json_object")
def _():
    r = chat(temperature=0.5, seed=2, max_tokens=80, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@case("guided_regex and guided_choice")
def _():
    r = chat(temperature=1, seed=3, max_tokens=20, extra_body={"guided_regex": "[a-c]{3}-[0-9]"})
    assert re.fullmatch("[a-c]{3}-[0-9]", r.choices[0].message.content)
    c = chat(temperature=1, seed=3, max_tokens=20, extra_body={"guided_choice": ["yes", "no"]})
    assert c.choices[0].message.content in ("yes", "no")


@case("tools with tool_choice required")
def _():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"], "additionalProperties": False}}}]
    r = chat(tools=tools, tool_choice="required", temperature=1, seed=4, max_tokens=60)
    if r.choices[0].finish_reason != "length":
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments)["city"], str)


@case("unknown model is 404 model_not_found")
def _():
    try:
        client.chat.completions.create(model="gpt-4o", messages=USER)
    except openai.NotFoundError as e:
        assert e.code == "model_not_found", f"code {e.code!r}: {e}"
        return
    raise AssertionError("accepted")


@case("context length: 400 context_length_exceeded")
def _():
    try:
        chat(messages=[{"role": "user", "content": "circle " * 5000}], max_tokens=4)
    except openai.BadRequestError as e:
        assert e.code == "context_length_exceeded", f"code {e.code!r}: {e}"
        return
    raise AssertionError("accepted")


@case("prefix caching: a repeated prompt's full blocks are cached_tokens; another cache_salt shares none")
def _():
    prompt = ("A purple hexagon sits below an orange circle, right of a grey square, and the "
              "picture has a black background with a thin white frame around it")
    ask = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    first = client.completions.create(**ask)
    again = client.completions.create(**ask)
    full = (first.usage.prompt_tokens - 1) // 16 * 16
    assert full > 0, first.usage
    assert again.usage.prompt_tokens_details.cached_tokens == full, again.usage
    assert again.choices[0].text == first.choices[0].text
    salted = client.completions.create(**ask, extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0, salted.usage
    assert salted.choices[0].text == first.choices[0].text


@case("priority: an integer is taken (the same text), anything else refused by name")
def _():
    ask = dict(model=MODEL, prompt="Count: one two", max_tokens=6, temperature=0, seed=3)
    plain = client.completions.create(**ask)
    urgent = client.completions.create(**ask, extra_body={"priority": -5})
    assert urgent.choices[0].text == plain.choices[0].text
    refused(400, "priority", extra_body={"priority": "high"})


@case("refused by name: best_of, suffix, an empty cache_salt, unknown fields")
def _():
    refused(400, "best_of", endpoint="completions", best_of=3)
    refused(400, "suffix", endpoint="completions", suffix="end")
    refused(400, "cache_salt", extra_body={"cache_salt": ""})
    refused(400, "frobnicate", extra_body={"frobnicate": 1})
    refused(400, "response_format", response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "number", "minimum": 3}}})


@case("models and health")
def _():
    assert client.models.retrieve(MODEL).id == MODEL


# The parameter table CI also runs (with curl): every row through the
# client, its status, its error's param and its expected values.
TABLE = json.load(open(__file__.rsplit("/", 2)[0] + "/tests/fixtures/api/parameters.json"))


def pointer(doc, path):
    for part in path.strip("/").split("/"):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


for row in TABLE["rows"]:
    @case("table: " + row["name"])
    def _(row=row):
        body = dict(TABLE["base"][row["endpoint"]])
        body.update({k: (MODEL if v == "<served>" else v) for k, v in row["body"].items()})
        body.setdefault("model", MODEL)
        path = "/chat/completions" if row["endpoint"] == "chat" else "/completions"
        try:
            if row.get("stream"):
                events = list(client.post(path, body=body, cast_to=object, stream=True,
                                          stream_cls=openai.Stream[object]))
                assert events, "no events"
                got = None
            else:
                got = client.post(path, body=body, cast_to=object)
        except openai.APIStatusError as e:
            assert e.status_code == row["status"], f"status {e.status_code}: {e}"
            err = e.body if isinstance(e.body, dict) else {}
            if "param" in row:
                assert err.get("param") == row["param"], f"param {err.get('param')!r}: {e}"
            if "code" in row:
                assert e.code == row["code"], f"code {e.code!r}"
            return
        assert row["status"] == 200, f"accepted, wanted {row['status']}"
        for path_, want in row.get("expect", {}).items():
            value = pointer(got, path_)
            assert (value is not None) if want == "<exists>" else value == want, (path_, value)


for name, verdict, why in results:
    print(f"{verdict} {name}" + (f": {why}" if why else ""))
failed = sum(v == "FAIL" for _, v, _ in results)
print(f"{len(results) - failed}/{len(results)} passed (openai {openai.__version__}, model {MODEL})")
sys.exit(1 if failed else 0)
