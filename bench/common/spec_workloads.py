"""The request sets of bench.spec: RAG, a code edit with a prediction, agent tool calls.

Extractive RAG, a code edit with a predicted output, and agent tool calls, as
chat-completions bodies.

Owns: the prompts (chosen so that SmolLM2-135M-Instruct really quotes its context: its answers
to the RAG set copy whole sentences of the document), the tools of the tool-call set, and how
a `prediction` is made from a reference answer. Does not know: HTTP, servers, timing.

Why the code edit's prediction is built from the model's own answer: a 135M model does not
rewrite a file faithfully, so "the original file" would not be ~90% of what it writes. A
client that knows most of the answer is modelled instead: the reference answer (greedy, no
speculation) with two of its twenty spans changed, so the prediction matches about 90% of the
answer and diverges in between, as an edit does.
"""

from __future__ import annotations

import difflib
from typing import Any

MODEL_FIELD = "model"

# (document, what to quote): encyclopedic paragraphs written for this benchmark.
RAG_SET: tuple[tuple[str, str], ...] = (
    ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
     "It is named after the engineer Gustave Eiffel, whose company designed and built the "
     "tower from 1887 to 1889. It was constructed as the centerpiece of the 1889 World's Fair. "
     "The tower is 330 metres tall, about the same height as an 81-storey building.",
     "how tall the tower is"),
    ("The Amazon River in South America is the largest river by discharge volume of water in "
     "the world. It flows from the Andes mountains in Peru to the Atlantic Ocean in Brazil. "
     "The river system drains an area of about seven million square kilometres. About one fifth "
     "of all the fresh water that flows into the oceans comes from the Amazon.",
     "how much fresh water comes from the Amazon"),
    ("The honey bee is a social insect that lives in colonies of up to sixty thousand workers. "
     "Each colony has a single queen, who lays all of the eggs. Worker bees collect nectar and "
     "pollen from flowers and turn the nectar into honey inside the hive. A bee communicates "
     "the location of flowers to other bees by performing a waggle dance.",
     "how bees tell each other where flowers are"),
    ("Mount Everest is the highest mountain above sea level on Earth. It lies in the Himalayas "
     "on the border between Nepal and China. Its summit is 8,849 metres above sea level. The "
     "first people known to reach the summit were Edmund Hillary and Tenzing Norgay in 1953.",
     "who first reached the summit"),
    ("The Great Wall of China is a series of fortifications built across the northern borders "
     "of ancient Chinese states. Most of the existing wall was built during the Ming dynasty. "
     "The wall was built to protect against raids by nomadic groups from the north. Its total "
     "length, with all of its branches, is more than twenty thousand kilometres.",
     "why the wall was built"),
    ("Photosynthesis is the process by which green plants make their own food. Plants take in "
     "carbon dioxide from the air and water from the soil. Using the energy of sunlight, they "
     "turn these into sugar and oxygen. The oxygen is released into the air, and the sugar is "
     "used by the plant to grow.",
     "what plants take in"),
    ("The Moon is the only natural satellite of the Earth. It orbits the Earth at an average "
     "distance of about 384,400 kilometres. The same side of the Moon always faces the Earth, "
     "because the Moon turns once on its axis in the time it takes to orbit the Earth. Neil "
     "Armstrong was the first person to walk on the Moon, in July 1969.",
     "why the same side of the Moon faces the Earth"),
    ("Coffee is a drink made from the roasted seeds of the coffee plant. The plant grows in "
     "tropical regions, and Brazil is the largest producer of coffee in the world. Coffee "
     "contains caffeine, which makes people feel more awake. The drink was first popular in "
     "Yemen in the fifteenth century and then spread to Europe.",
     "where coffee was first popular"),
)

RAG_MAX_TOKENS = 128


def rag_body(model: str, doc: str, what: str) -> dict[str, Any]:
    return {MODEL_FIELD: model, "temperature": 0, "max_tokens": RAG_MAX_TOKENS,
            "messages": [{"role": "user", "content":
                          f"Document:\n{doc}\n\nQuestion: {what}? Answer with the sentences of "
                          "the document that answer it, quoted word for word, and the "
                          "sentences around them."}]}


CODE_FILES: tuple[str, ...] = (
    "def average(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n\n\ndef largest(values):\n    best = values[0]\n"
    "    for v in values:\n        if v > best:\n            best = v\n    return best\n\n\n"
    "def smallest(values):\n    best = values[0]\n    for v in values:\n        if v < best:\n"
    "            best = v\n    return best\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n"
    "        return self.items.pop()\n\n    def peek(self):\n        return self.items[-1]\n\n"
    "    def is_empty(self):\n        return len(self.items) == 0\n\n    def size(self):\n"
    "        return len(self.items)\n",
)
CODE_MAX_TOKENS = 256
EDITED_SPANS = (5, 14)  # of 20 equal spans of the answer: these two differ in the prediction


def code_body(model: str, source: str) -> dict[str, Any]:
    return {MODEL_FIELD: model, "temperature": 0, "max_tokens": CODE_MAX_TOKENS,
            "messages": [{"role": "user", "content":
                          f"```python\n{source}```\n\nCopy the code above, and explain it."}]}


def predicted(answer: str) -> str:
    """`answer` with two of its twenty spans (by characters) blanked out: the prediction matches
    about 90% of the answer and diverges twice in between, as an edit does."""
    n = len(answer)
    cuts = [n * i // 20 for i in range(21)]
    parts = [answer[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    for i in EDITED_SPANS:
        parts[i] = "~" * len(parts[i])
    return "".join(parts)


def overlap(prediction: str, answer: str) -> float:
    """The fraction of `answer` (characters) that matching blocks of `prediction` cover."""
    if not answer:
        return 0.0
    m = difflib.SequenceMatcher(None, prediction, answer, autojunk=False)
    return sum(b.size for b in m.get_matching_blocks()) / len(answer)


def with_prediction(body: dict[str, Any], prediction: str) -> dict[str, Any]:
    return {**body, "prediction": {"type": "content", "content": prediction}}


# Agent tool calls: a named tool choice over schemas whose keys and enums the grammar forces.
TOOL_PARAMS: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["destination_city", "departure_date", "number_of_travellers", "cabin_class",
                 "include_hotel_recommendations"],
    "properties": {
        "destination_city": {"type": "string", "maxLength": 32},
        "departure_date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
        "number_of_travellers": {"type": "integer", "minimum": 1, "maximum": 9},
        "cabin_class": {"type": "string",
                        "enum": ["economy_class", "premium_economy_class", "business_class"]},
        "include_hotel_recommendations": {"type": "boolean"},
    },
}
TOOL = {"type": "function", "function": {
    "name": "search_flights_and_hotels", "parameters": TOOL_PARAMS,
    "description": "Search flights (and optionally hotels) for a trip"}}
TOOL_QUESTIONS: tuple[str, ...] = (
    "Find me a flight to Paris on 2026-05-04 for two people in business class, with hotels.",
    "I need to fly to Tokyo next month with my family of four, economy is fine.",
    "Book a trip to Rome for one traveller on 2026-09-12, premium economy, no hotels.",
    "Search flights to New York for three people on 2026-12-20.",
    "Plan a flight to Berlin for me and a colleague, business class, on 2026-03-15.",
    "Look up flights to Madrid on 2026-07-01 for one person, and suggest hotels.",
)
TOOL_MAX_TOKENS = 128


def tool_body(model: str, question: str) -> dict[str, Any]:
    return {MODEL_FIELD: model, "temperature": 0, "max_tokens": TOOL_MAX_TOKENS,
            "messages": [{"role": "user", "content": question}], "tools": [TOOL],
            "tool_choice": {"type": "function",
                            "function": {"name": "search_flights_and_hotels"}}}
