"""The offline API exactly as the issues show it, and the process boundary it must not cross.

`from radixserve import LLM, SamplingParams`; outputs with `.token_ids`, `.text`,
`.finish_reason` ("stop" | "length" | "abort"), `.num_prompt_tokens`, `.num_cached_tokens`;
`llm.chat(conversations, params)` over a list of conversations.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.repo import DOCS, REPO_ROOT


def test_package_import_is_lazy_and_api_side_modules_never_load_torch() -> None:
    """A fresh interpreter: the API process's and the router's entry modules, and the package
    itself, import without torch or the engine side."""
    code = (
        "import sys\n"
        "import radixserve, radixserve.cli, radixserve.server.app, radixserve.ipc.client\n"
        "import router.__main__, router.app\n"
        "from radixserve import SamplingParams\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(("
        "'torch.', 'radixserve.engine', 'radixserve.sched', 'radixserve.model.', "
        "'triton_kernels')))\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "", f"imported on the API side: {out.stdout.strip()}"


def test_llm_outputs_have_vllm_field_names(tiny_llama: Path) -> None:
    from radixserve import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_tokens=4096)
    prompts = [[5, 6, 7], [9] * 40, [11, 12]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 6, 1)]
    outs = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in outs] == prompts  # one output per prompt, in order
    assert [len(o.token_ids) for o in outs] == [4, 6, 1]
    assert [o.num_prompt_tokens for o in outs] == [3, 40, 2]
    assert all(o.finish_reason == "length" for o in outs)
    assert all(isinstance(o.text, str) for o in outs)
    assert outs[0].outputs[0].token_ids == outs[0].token_ids  # vLLM's nested spelling
    again = llm.generate([[9] * 40], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert again[0].num_cached_tokens == 39  # all but the last prompt token, from the tree
    assert again[0].token_ids == outs[1].token_ids
    llm.engine.check_integrity()


def test_generate_rejects_mismatched_lengths_and_drops_nothing(tiny_llama: Path) -> None:
    from radixserve import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_tokens=4096)
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match="3 prompts but 2 params"):
        llm.generate([[1, 2], [3, 4], [5, 6]], [greedy, greedy])
    with pytest.raises(ValueError, match="2 prompts but 1 cache_salt"):
        llm.generate([[1, 2], [3, 4]], greedy, cache_salt=["a"])
    with pytest.raises(TypeError, match="list of lists"):
        llm.generate([1, 2, 3], greedy)  # type: ignore[list-item]
    # A bad prompt among good ones: all or nothing, and the engine is left clean.
    from radixserve.types import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2], [10**6]], greedy)
    assert not llm.engine.has_work() and llm.kv_stats()["kv_held_tokens"] == 0
    outs = llm.generate([[1, 2], [3, 4]], greedy)
    assert [len(o.token_ids) for o in outs] == [2, 2]


@pytest.mark.slow
@pytest.mark.smollm2
def test_issue_snippet_with_the_default_model() -> None:
    """The foundation issue's snippet, pasted as written."""
    from radixserve import LLM, SamplingParams
    llm = LLM(model="smollm2-135m", dtype="auto", device="auto")   # dtype: float32 | bfloat16 | auto; device: cpu | cuda | auto
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))

    assert len(outs) == 2
    for o in outs:
        assert o.finish_reason in ("stop", "length")
        assert 1 <= len(o.token_ids) <= 32 and o.text.strip()
        assert o.num_prompt_tokens > 0 and o.num_cached_tokens == 0
    conv = [{"role": "user", "content": "Say hello."}]
    chats = llm.chat([conv, conv], SamplingParams(max_tokens=8, temperature=0.0))
    single = llm.chat(conv, SamplingParams(max_tokens=8, temperature=0.0))
    assert len(chats) == 2 and len(single) == 1
    assert chats[0].token_ids == chats[1].token_ids == single[0].token_ids
    assert single[0].num_cached_tokens > 0  # the same conversation again hits the tree


def test_offline_structured_output_constructors(tiny_llama: Path) -> None:
    import json
    import re

    import jsonschema

    from radixserve import LLM, Constraint, SamplingParams
    from radixserve.constraints import ConstraintKind
    from radixserve.types import InvalidRequestError

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["n"], "additionalProperties": False}
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_tokens=4096)
    params = [SamplingParams(temperature=0, max_tokens=32, constraint=c) for c in (
        Constraint.json_schema(schema), Constraint.regex("[a-c]{3}"),
        Constraint.choice(["left", "right", "left"]), Constraint.grammar('root ::= "x" [0-9]'))]
    outs = llm.generate(["a", "b", "c", "d"], params)
    assert [o.finish_reason for o in outs] == ["stop"] * 4
    jsonschema.validate(json.loads(outs[0].text), schema)
    assert re.fullmatch("[a-c]{3}", outs[1].text)
    assert outs[2].text in ("left", "right")
    assert re.fullmatch("x[0-9]", outs[3].text)
    assert Constraint.json_object() == Constraint(ConstraintKind.JSON_OBJECT)
    with pytest.raises(InvalidRequestError):
        llm.generate("a", SamplingParams(constraint=Constraint.regex("(unclosed")))


@pytest.mark.slow
@pytest.mark.smollm2
def test_readme_offline_structured_output_snippet() -> None:
    import json

    import jsonschema

    page = (DOCS / "serving.md").read_text()
    code = page.split("Offline:\n\n```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(compile(code, "docs/serving.md", "exec"), scope)  # noqa: S102
    out = scope["out"]
    assert out.finish_reason == "stop"  # type: ignore[attr-defined]
    jsonschema.validate(json.loads(out.text), scope["person"])  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.smollm2
def test_readme_offline_chat_with_tools_snippet() -> None:
    """The README's offline quick start, then docs/serving.md's LLM.chat(tools=...) snippet,
    as written."""
    import json

    import jsonschema

    readme = (REPO_ROOT / "README.md").read_text()
    quick = readme.split("Offline, without HTTP:\n\n```python\n", 1)[1].split("```", 1)[0]
    page = (DOCS / "serving.md").read_text()
    tools = page.split("stays raw, and the calls are read back into `o.tool_calls` "
                       "(OpenAI's shape):\n\n```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(compile(quick + tools, "README.md + docs/serving.md", "exec"), scope)  # noqa: S102
    out = scope["out"]
    (call, *_) = out.tool_calls  # type: ignore[attr-defined]
    assert call["function"]["name"] == "get_weather"
    schema = scope["weather"]["function"]["parameters"]  # type: ignore[index]
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_offline_logit_bias_as_vllm_spells_it(tiny_llama: Path) -> None:
    from radixserve import LLM, SamplingParams
    from radixserve.types import InvalidRequestError

    llm = LLM(model=str(tiny_llama), dtype="float32")
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4,
                                                      logit_bias={42: 100}))
    assert out.token_ids == [42] * 4
    with pytest.raises(InvalidRequestError, match="logit_bias token ids"):
        llm.generate([[5, 6, 7]], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(InvalidRequestError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101})
    assert SamplingParams(logit_bias={3: 1, 1: -2}) == \
        SamplingParams(logit_bias=((1, -2.0), (3, 1.0)))
    hash(SamplingParams(logit_bias={3: 1}))  # still a frozen, hashable value


def test_offline_n_sequences_per_prompt(tiny_llama: Path) -> None:
    """vLLM's SamplingParams(n=...): out.outputs holds n sequences; a seeded prompt's sequence
    i samples with seed + i (as the server's choice i), so the call is reproducible."""
    from radixserve import LLM, SamplingParams
    from radixserve.types import InvalidRequestError

    llm = LLM(model=str(tiny_llama), dtype="float32")
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    a, b = llm.generate([[5, 6, 7], [8, 9]], sp)
    assert [o.index for o in a.outputs] == [0, 1, 2] and a.outputs[0] is a
    assert all(len(o.token_ids) == 6 and o.prompt_token_ids == [5, 6, 7] for o in a.outputs)
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # three draws, not one thrice
    again = llm.generate([[5, 6, 7]], sp)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in a.outputs]
    # sequence i is what a single request with seed + i samples
    one = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=6, max_tokens=6,
                                                   ignore_eos=True))[0]
    assert one.token_ids == a.outputs[1].token_ids
    assert len(b.outputs) == 3 and b.outputs[2].text == llm.tokenizer.decode(
        b.outputs[2].token_ids, skip_special_tokens=True)
    greedy = llm.generate([[5, 6, 7]], SamplingParams(n=2, temperature=0, max_tokens=4))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    for bad_n in (0, 129, 1.5, True):
        with pytest.raises(InvalidRequestError, match="n must be"):
            SamplingParams(n=bad_n)  # type: ignore[arg-type]
