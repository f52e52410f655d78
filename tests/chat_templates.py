"""Chat templates of the model families the tests serve: Qwen3's own (thinking on and off,
Hermes tool calls), a DeepSeek-R1-style one that opens `<think>` in the prompt, and Gemma's
(no system role: folded into the first user turn); a tiny Qwen3 shaped as the real one's
tokenizer is.

Owns: the templates (Qwen3's is its published text; the others are written after each
family's published template logic), a tiny Llama folder that carries one, and a tiny
`Qwen3ForCausalLM` folder with Qwen3's added tokens and template. Does not know: what a test
checks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from tests.tiny_models import make_tiny_model, make_tokenizer

# Qwen3's chat template as Qwen publishes it (Qwen3-0.6B ... Qwen3-32B tokenizer_config.json):
# the system turn (with a tools block when tools are given), the last user query found from the
# end (tool responses do not count), assistant turns after it keep their reasoning in <think>
# blocks, tool results grouped into one user turn, and the generation prompt with an empty
# closed <think> block when enable_thinking is false.
QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# DeepSeek-R1's habit: the generation prompt itself opens the thinking block, so the model's
# output holds only the closing tag.
R1_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

# Gemma's logic: no system role (its text is put before the first user turn's), roles must
# alternate user/assistant (a template error otherwise), the assistant is "model".
GEMMA_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
{{- message['content'] | trim }}{{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""



# Qwen3's added tokens after its control tokens (tests/tiny_models.SPECIALS), in Qwen3's
# order, none of them special (its tokenizer_config.json: "special": false), so they are text
# a grammar may match and decoding keeps them.
QWEN3_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
              "</think>")


def make_templated_model(path: Path, template: str) -> Path:
    """A tiny random Llama whose tokenizer carries `template` (one token per byte and the
    ChatML control tokens: `<think>` is five tokens)."""
    tokenizer = make_tokenizer()
    make_tiny_model(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


def make_qwen3_tokenizer() -> PreTrainedTokenizerFast:
    """tests/tiny_models' byte tokenizer plus Qwen3's tags as added, not special, tokens
    (each one token, as in Qwen3's vocabulary) and Qwen3's chat template."""
    tokenizer = make_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_TAGS])
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


def make_qwen3_model(path: Path, seed: int = 0) -> Path:
    """A tiny random `Qwen3ForCausalLM` (transformers' Qwen3Config: QK-norm, head_dim not
    hidden / heads, tied embeddings as the small Qwen3s) with make_qwen3_tokenizer's
    tokenizer."""
    tokenizer = make_qwen3_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)  # larger than the init default: outputs vary with the input
    model.config.dtype = torch.float32
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
