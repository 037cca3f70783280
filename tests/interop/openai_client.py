"""The official OpenAI Python client (PyPI `openai`) against the SIMD example engine's server.

Usage: python3 openai_client.py BASE_URL MODEL_ID

Completions, chat completions, streaming (equal to the non-streaming text), concurrent requests
(greedy outputs all equal), and a bad request answered 400 with OpenAI's error shape, after which
the server still answers.
"""

import sys
from concurrent.futures import ThreadPoolExecutor

import openai

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)

models = [m.id for m in client.models.list()]
assert models == [model], models

prompt = "Once upon a time"
c = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
text = c.choices[0].text
assert text and c.choices[0].finish_reason in ("length", "stop"), c
assert c.usage.completion_tokens >= 1 and c.usage.prompt_tokens >= 1, c.usage
print(f"completion: {text!r} ({c.usage.completion_tokens} tokens)")

streamed = "".join(
    chunk.choices[0].text
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True)
)
assert streamed == text, (streamed, text)
print("streaming equals non-streaming")

chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16, temperature=0
)
assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content is not None, chat
chunks = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16, temperature=0, stream=True
)
streamed_chat = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
assert streamed_chat == chat.choices[0].message.content, (streamed_chat, chat.choices[0].message.content)
print(f"chat: {chat.choices[0].message.content!r}")

with ThreadPoolExecutor(max_workers=8) as pool:
    outs = list(
        pool.map(
            lambda _: client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0).choices[0].text,
            range(16),
        )
    )
assert all(o == text for o in outs), outs
print("16 concurrent greedy requests: all equal")

try:
    client.completions.create(model=model, prompt=prompt, max_tokens=-1)
    raise SystemExit("a negative max_tokens was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "max_tokens" in str(e), e
try:
    client.completions.create(model="no-such-model", prompt=prompt, max_tokens=4)
    raise SystemExit("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404, e
again = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
assert again == text, (again, text)
print("bad requests: 400 and 404 with OpenAI errors; the server still answers")
