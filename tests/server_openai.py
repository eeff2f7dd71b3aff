"""lathe serve through the official `openai` Python client.

Run by tests/server.rs (test `openai_python_client`) against a server it started, with
LATHE_URL (the base URL, ending in /v1) and LATHE_API_KEY set. Needs `pip install openai`.
Prints one line per check and `N passed, 0 failed` at the end; exits non-zero on a failure.
"""

import concurrent.futures
import os
import sys

import openai
from openai import OpenAI

URL = os.environ["LATHE_URL"]
KEY = os.environ.get("LATHE_API_KEY", "none")
# Ban EOS (id 1 in the test model's vocabulary) so replies run to max_tokens.
NO_EOS = {"1": -100}

client = OpenAI(base_url=URL, api_key=KEY, max_retries=0, timeout=60)
passed = 0


def check(name, cond, detail=""):
    global passed
    if not cond:
        print(f"FAIL {name}: {detail}")
        print(f"{passed} passed, 1 failed")
        sys.exit(1)
    passed += 1
    print(f"ok {name}")


def chat(text, stream=False, **kw):
    return client.chat.completions.create(
        model="anything",
        messages=[{"role": "user", "content": text}],
        max_tokens=kw.pop("max_tokens", 12),
        temperature=0,
        logit_bias=NO_EOS,
        stream=stream,
        **kw,
    )


models = client.models.list()
check("models.list", len(models.data) == 1 and models.data[0].object == "model", models)

r = chat("Hello")
check("chat object", r.object == "chat.completion", r)
check("chat finish_reason", r.choices[0].finish_reason == "length", r.choices[0])
check("chat usage", r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0, r.usage)
whole = r.choices[0].message.content
check("chat content", isinstance(whole, str) and whole != "", r.choices[0].message)

chunks = list(chat("Hello", stream=True, stream_options={"include_usage": True}))
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check("stream text equals the whole reply", text == whole, (text, whole))
finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
check("stream finish_reason", finish == ["length"], finish)
check("stream usage chunk", chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12, chunks[-1])

lp = chat("Hi", max_tokens=4, logprobs=True, top_logprobs=2)
content = lp.choices[0].logprobs.content
check("chat logprobs", len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content), content)

c = client.completions.create(model="m", prompt="Once upon a time", max_tokens=8, temperature=0, logit_bias=NO_EOS)
check("completion", c.object == "text_completion" and c.choices[0].finish_reason == "length", c)
cs = client.completions.create(
    model="m", prompt="Once upon a time", max_tokens=8, temperature=0, logit_bias=NO_EOS, stream=True
)
check("completion stream", "".join(x.choices[0].text for x in cs if x.choices) == c.choices[0].text)

# Several clients at once: each gets what it got alone (greedy).
prompts = ["one", "two two", "three three three", "four", "five", "six"]
alone = [chat(p).choices[0].message.content for p in prompts]


def streamed(p):
    return "".join(x.choices[0].delta.content or "" for x in chat(p, stream=True) if x.choices)


def one(i_p):
    i, p = i_p
    return streamed(p) if i % 2 else chat(p).choices[0].message.content


with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
    together = list(pool.map(one, enumerate(prompts)))
check("concurrent clients match", together == alone, (together, alone))

# n > 1: greedy choices are equal, indexed 0..n; usage sums their tokens.
r = chat("Hello", n=3, max_tokens=5)
check("n=3 choices", [c.index for c in r.choices] == [0, 1, 2], r.choices)
check("n=3 greedy equal", len({c.message.content for c in r.choices}) == 1, r.choices)
check("n=3 usage", r.usage.completion_tokens == 15, r.usage)
per = {}
for c in chat("Hello", stream=True, n=2, max_tokens=5):
    for ch in c.choices:
        per[ch.index] = per.get(ch.index, "") + (ch.delta.content or "")
check("n=2 stream by index", per == {0: r.choices[0].message.content, 1: r.choices[1].message.content}, per)
seeded = [
    client.completions.create(
        model="m", prompt="Dice:", max_tokens=8, temperature=1.0, top_p=1.0, seed=5, n=2, logit_bias=NO_EOS
    )
    for _ in range(2)
]
texts = [[c.text for c in s.choices] for s in seeded]
check("n=2 seeded repeatable, distinct", texts[0] == texts[1] and texts[0][0] != texts[0][1], texts)
try:
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=5)
    check("n over --parallel refused", False, "no error")
except openai.BadRequestError as e:
    check("n over --parallel refused", e.status_code == 400 and e.body.get("param") == "n", e.body)

# The Responses API: the same reply as the chat, whole and as named stream events.
want = chat("Hello", max_tokens=6).choices[0].message.content
rs = client.responses.create(
    model="m", input="Hello", max_output_tokens=6, temperature=0, extra_body={"logit_bias": NO_EOS}
)
check("responses output_text", rs.output_text == want and rs.output[0].type == "message", rs)
check("responses usage", rs.usage.output_tokens == 6 and rs.usage.input_tokens > 0, rs.usage)
check("responses incomplete", rs.status == "incomplete" and rs.incomplete_details.reason == "max_output_tokens", rs)
events = list(
    client.responses.create(
        model="m",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
        max_output_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"logit_bias": NO_EOS},
    )
)
kinds = [e.type for e in events]
check("responses stream events", kinds[0] == "response.created" and kinds[-1] == "response.incomplete", kinds)
deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
check("responses stream text", deltas == want, (deltas, want))
tool = {
    "type": "function",
    "name": "now",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
}
rt = client.responses.create(model="m", input="time?", tools=[tool], tool_choice="required", max_output_tokens=60)
calls = [o for o in rt.output if o.type == "function_call"]
check("responses function_call", len(calls) == 1 and calls[0].name == "now", rt.output)
try:
    client.responses.create(model="m", input="x", previous_response_id="resp_1")
    check("previous_response_id refused", False, "no error")
except openai.BadRequestError as e:
    check("previous_response_id refused", e.status_code == 400 and e.body.get("param") == "previous_response_id", e.body)

# Embeddings: the client asks for base64 by default and decodes it; float gives the same values.
e64 = client.embeddings.create(model="m", input=["The quick brown fox", "Jumps"])
ef = client.embeddings.create(model="m", input="The quick brown fox", encoding_format="float")
v = e64.data[0].embedding
check("embeddings shape", len(e64.data) == 2 and [d.index for d in e64.data] == [0, 1] and len(v) > 0, e64)
check("embeddings unit norm", abs(sum(x * x for x in v) - 1) < 1e-4, sum(x * x for x in v))
check("embeddings base64 = float", max(abs(a - b) for a, b in zip(v, ef.data[0].embedding)) < 1e-6)
check("embeddings usage", e64.usage.prompt_tokens > ef.usage.prompt_tokens > 0, e64.usage)
try:
    client.embeddings.create(model="m", input="x", dimensions=3)
    check("embeddings dimensions refused", False, "no error")
except openai.BadRequestError as e:
    check("embeddings dimensions refused", e.status_code == 400 and e.body.get("param") == "dimensions", e.body)

try:
    OpenAI(base_url=URL, api_key="wrong", max_retries=0).models.list()
    check("wrong key refused", False, "no error")
except openai.AuthenticationError as e:
    check("wrong key refused", e.status_code == 401, e)

print(f"{passed} passed, 0 failed")
