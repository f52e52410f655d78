"""OpenAI's Predicted Outputs field: `prediction: {"type": "content", "content": ...}`.

Owns: validating the field (content: a string, or a list of text parts) into the predicted
text. Does not know: tokenizers, the engine (the predicted text is tokenized by the server
state and sent to the engine as a draft source for the request: radixserve/spec).
"""

from __future__ import annotations

from typing import Any

from radixserve.api.fields import bad, check_fields

PARAM = "prediction"
MAX_PREDICTION_CHARS = 1 << 20


def parse_prediction(value: Any) -> str | None:
    """The predicted text, or None when the field is absent. InvalidRequestError (400) names
    the offending part."""
    if value is None:
        return None
    check_fields(value, frozenset({"type", "content"}), PARAM)
    if value.get("type") != "content":
        raise bad(f"'{PARAM}.type' must be \"content\", got {value.get('type')!r}",
                  f"{PARAM}.type")
    content = value.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(_text_part(part, i) for i, part in enumerate(content))
    else:
        raise bad(f"'{PARAM}.content' must be a string or a list of text parts",
                  f"{PARAM}.content")
    if len(text) > MAX_PREDICTION_CHARS:
        raise bad(f"'{PARAM}.content' is longer than {MAX_PREDICTION_CHARS} characters",
                  f"{PARAM}.content")
    return text


def _text_part(part: Any, index: int) -> str:
    where = f"{PARAM}.content[{index}]"
    check_fields(part, frozenset({"type", "text"}), where)
    if part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise bad(f"'{where}' must be {{\"type\": \"text\", \"text\": <string>}}", where)
    text: str = part["text"]
    return text
