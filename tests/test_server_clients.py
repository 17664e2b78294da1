"""The clients people use, against the live server over loopback (issue 44 item 8): LangChain's
`ChatOpenAI` (langchain-openai) and litellm, each in its own way of calling, get what the
`openai` client gets: the same greedy text, whole and streamed, logprobs and n.
"""

from __future__ import annotations

import os

import pytest

# litellm fetches a price list from the internet at import unless told to use its own copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
# langchain-openai and litellm are imported by their tests, not here: at collection every xdist
# worker paid their ~3 s of imports, the one that does not run this module included

from loopback import NAME, openai_client, serving, speculative_byte_engine  # noqa: E402

# litellm's own pydantic models warn about themselves at import
pytestmark = pytest.mark.filterwarnings("ignore:Items? .* `ReadOnly` qualifier:UserWarning")

CONTEXT = 128
NEW = 12
QUESTION = "abcabcab"


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serving(speculative_byte_engine(tmp_path_factory.mktemp("bytes"), CONTEXT),
                 CONTEXT) as base:
        yield base


@pytest.fixture(scope="module")
def reference(url):
    """The `openai` client's greedy answer: what every other client must get."""
    out = openai_client(url).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTION}], max_tokens=NEW,
        temperature=0, logprobs=True, top_logprobs=2)
    return out.choices[0]


def test_langchain_chat_openai_invokes_and_streams(url, reference):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=url + "/v1", api_key="none", model=NAME,
                                      temperature=0, max_tokens=NEW, max_retries=0)
    message = llm.invoke(QUESTION)
    assert message.content == reference.message.content and message.content
    assert message.usage_metadata["output_tokens"] > 0
    assert "".join(chunk.content for chunk in llm.stream(QUESTION)) == message.content
    scored = llm.bind(logprobs=True).invoke(QUESTION).response_metadata["logprobs"]["content"]
    assert [e["logprob"] for e in scored] == pytest.approx(
        [e.logprob for e in reference.logprobs.content], abs=1e-4)


def test_litellm_completion_whole_streamed_and_n(url, reference):
    litellm = pytest.importorskip("litellm")
    ask = dict(model=f"openai/{NAME}", api_base=url + "/v1", api_key="none",
               messages=[{"role": "user", "content": QUESTION}], max_tokens=NEW, temperature=0)
    out = litellm.completion(logprobs=True, top_logprobs=2, **ask)
    assert out.choices[0].message.content == reference.message.content
    assert [e.logprob for e in out.choices[0].logprobs.content] == pytest.approx(
        [e.logprob for e in reference.logprobs.content], abs=1e-4)
    streamed = litellm.completion(stream=True, **ask)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == (
        reference.message.content)
    sampled = litellm.completion(**(ask | {"temperature": 1.0}), n=3, seed=4)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len({c.message.content for c in sampled.choices}) > 1
