"""How tools, tool calls and tool results reach the prompt: the documented fallback for
templates without tool support (ours and SmolLM2's), and the template's own rendering."""

from __future__ import annotations

from typing import Any

from radixserve.api.protocol import parse_chat
from radixserve.api.tools.parsers import get_format
from radixserve.api.tools.prompt import supports_tools, template_messages
from radixserve.tokenizer import render_chat
from tests.tiny_models import CHAT_TEMPLATE, make_tokenizer

HERMES = get_format("hermes")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TURN1: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Weather in Paris?"}]
TURN2: list[dict[str, Any]] = [*TURN1,
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_9", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "call_9", "content": "21C, sunny"},
         {"role": "tool", "tool_call_id": "call_9", "content": "wind 5 km/h"}]
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }}="
    "{{ t.function.parameters.required | join(',') }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments.city }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "{% if m.role == 'tool' %} [{{ m.tool_call_id }} {{ m.name }}]{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def rendered(messages: list[dict[str, Any]], native: bool = False, parser: str = "hermes",
             **fields: Any) -> str:
    tok = make_tokenizer()
    if native:
        tok.chat_template = NATIVE_TEMPLATE
    req = parse_chat({"messages": messages, **fields})
    msgs, tools = template_messages(req.messages, req.tools, get_format(parser),
                                    supports_tools(tok.chat_template))
    return render_chat(tok, msgs, tools=tools)


def test_support_is_detected_from_the_template() -> None:
    assert not supports_tools(CHAT_TEMPLATE)
    assert supports_tools(NATIVE_TEMPLATE)
    assert not supports_tools(None)


def test_without_tools_the_prompt_is_unchanged() -> None:
    assert rendered(TURN1) == render_chat(make_tokenizer(), TURN1)
    assert rendered(TURN1, native=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_fallback_puts_tools_in_the_system_message_and_history_in_hermes_form() -> None:
    text = rendered(TURN2, tools=[WEATHER])
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more of the functions "
        "below to help with the request. Each is described by a JSON object on its own line "
        "inside <tools></tools>:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Current '
        'weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
        '"required": ["city"]}}}\n</tools>\n\n'
        "To call a function, reply with one <tool_call></tool_call> block per call, each holding "
        "a JSON object with the function's name and its arguments:\n<tool_call>\n"
        '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21C, sunny\n</tool_response>\n<tool_response>\n"
        "wind 5 km/h\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_fallback_adds_a_system_message_when_there_is_none() -> None:
    text = rendered(TURN2[1:], tools=[WEATHER], tool_choice="none")
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call")
    assert text.count("<|im_start|>system") == 1


def test_fallback_in_llama3_json_form() -> None:
    turn = [*TURN1, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}]
    text = rendered(turn, parser="llama3_json", tools=[WEATHER])
    assert 'reply with only a JSON object holding the function\'s name and its parameters' in text
    assert ('<|im_start|>assistant\nChecking.\n{"name": "f", "parameters": {"x": 1}}; '
            '{"name": "g", "parameters": {}}<|im_end|>') in text


def test_same_tools_give_the_same_prefix_turn_after_turn() -> None:
    """What makes the radix cache hit for an agent: turn 1's prompt (before the generation
    prompt) is a prefix of turn 2's."""
    first = rendered(TURN1, tools=[WEATHER])
    second = rendered(TURN2, tools=[WEATHER])
    shared = first.removesuffix("<|im_start|>assistant\n")
    assert second.startswith(shared) and len(shared) > 500
    assert rendered(TURN1, tools=[WEATHER], tool_choice="required") == first


def test_native_template_gets_tools_calls_as_objects_and_result_names() -> None:
    text = rendered(TURN2, native=True, tools=[WEATHER])
    assert text == (
        "<|im_start|>system\nTOOLS:get_weather=city;<|im_end|>\n"
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\nCALL call_9 get_weather Paris<|im_end|>\n"
        "<|im_start|>tool\n21C, sunny [call_9 get_weather]<|im_end|>\n"
        "<|im_start|>tool\nwind 5 km/h [call_9 get_weather]<|im_end|>\n"
        "<|im_start|>assistant\n")
