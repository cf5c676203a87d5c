"""Structured-output tasks (a prompt and the JSON schema its answer follows), shared by the
structured-output and resident benchmarks, and a schema as llama.cpp's GBNF grammar, so that
llama.cpp's tools generate the same tokens as localspec under the same constraint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


def _string(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


@dataclass(frozen=True)
class Task:
    prompt: str
    schema: dict[str, Any]
    extraction: bool = False  # an extraction task (the per-task target)


TASKS: dict[str, Task] = {
    "email": Task(
        "Extract the sender's details from this email as JSON.\n\n"
        "From: Maria Gonzalez <maria.gonzalez@brightwave-analytics.com>\n"
        "Subject: Follow-up on the data platform proposal\n\n"
        "Hi Tom,\n\nThanks for the call yesterday. As discussed, I'd like to schedule the technical review "
        "for Thursday, March 14th at 10:30. You can reach me at +1 (415) 555-0142 if anything changes.\n\n"
        "Best regards,\nMaria Gonzalez\nSenior Solutions Architect, BrightWave Analytics\n",
        _object({"name": _string(60), "email": _string(80), "phone": _string(30), "company": _string(60),
                 "job_title": _string(60), "meeting": _string(60)}),
        extraction=True),
    "invoice": Task(
        "Extract the invoice's fields as JSON.\n\n"
        "INVOICE INV-2024-0873\nDate: 2024-05-17\n"
        "Bill to: Northwind Traders Ltd., 42 Harbour Street, Portsmouth PO1 3AX, United Kingdom\n"
        "Items: 12 x Ergonomic office chair (model EC-400) @ 189.00 GBP\n"
        "Total due: 2268.00 GBP\nPayment terms: Net 30\n"
        "Questions: accounts@northwind-traders.co.uk\n",
        _object({"invoice_number": _string(30), "date": _string(20), "customer": _string(80),
                 "address": _string(120), "item": _string(80), "quantity": {"type": "integer"},
                 "total": {"type": "number"}, "currency": {"enum": ["GBP", "EUR", "USD"]},
                 "contact_email": _string(80)}),
        extraction=True),
    "table": Task(
        "Convert this table into a JSON list of records.\n\n"
        "| Name | Department | Start year | Office |\n|---|---|---|---|\n"
        "| Alice Chen | Engineering | 2019 | Berlin |\n| Bob Okafor | Sales | 2021 | Lagos |\n"
        "| Carla Diaz | Marketing | 2018 | Madrid |\n| David Kim | Engineering | 2022 | Seoul |\n"
        "| Emma Novak | Finance | 2020 | Prague |\n",
        _object({"records": {"type": "array", "maxItems": 8, "items": _object({
            "name": _string(40), "department": _string(40), "start_year": {"type": "integer"},
            "office": _string(40)})}})),
    "classify": Task(
        "Classify this support ticket and give a one-sentence reason, as JSON.\n\n"
        "Ticket: I was charged twice for my March subscription (two payments of $29.99 on March 3rd). "
        "Please refund the duplicate charge as soon as possible, my account is anna.berg@example.com.\n",
        _object({"category": {"enum": ["billing", "technical", "account", "shipping", "other"]},
                 "priority": {"enum": ["low", "medium", "high", "urgent"]}, "reason": _string(300)})),
    "code": Task(
        "Write a Python function `is_palindrome(s)` that ignores case and every character that is not a "
        "letter or a digit. Answer as JSON with the function's name, its code, and one example call.\n",
        _object({"function_name": _string(40), "code": _string(1200), "example": _string(200)})),
    "story": Task(  # free text in one long string: the constraint's own cost
        "Write a short story of about 150 words about a lighthouse keeper who finds a message in a bottle. "
        "Answer as JSON with a title and the story.\n",
        _object({"title": _string(100), "story": _string(2000)})),
}


CHAR = r'( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )'
INTEGER = '"-"? ( "0" | [1-9] [0-9]{0,15} )'


def gbnf(schema: dict[str, Any]) -> str:
    """A GBNF grammar of the task schemas' subset (objects with every property required, in order;
    strings with maxLength; integers, numbers, enums, arrays with maxItems) in localspec's
    compact layout (", " and ": ", no other whitespace): llama-completion then generates the
    same tokens as localspec, and the two compare by wall time."""
    rules: dict[str, str] = {"char": CHAR}

    def rule(s: dict[str, Any]) -> str:
        if "enum" in s:
            return " | ".join(json.dumps(json.dumps(v)) for v in s["enum"])
        kind = s["type"]
        if kind == "object":
            fields = ' ", " '.join(f"{json.dumps(json.dumps(k) + ': ')} ( {rule(v)} )" for k, v in s["properties"].items())
            return f'"{{" {fields} "}}"'
        if kind == "array":
            item = f"( {rule(s['items'])} )"
            return f'"[" ( {item} ( ", " {item} ){{0,{s["maxItems"] - 1}}} )? "]"'
        if kind == "string":
            return f'"\\"" char{{0,{s["maxLength"]}}} "\\""'
        if kind == "integer":
            return INTEGER
        if kind == "number":
            return f'{INTEGER} ( "." [0-9]{{1,16}} )? ( [eE] [-+]? [0-9]{{1,3}} )?'
        raise ValueError(f"no GBNF for {s}")

    rules["root"] = rule(schema)
    return "\n".join(f"{name} ::= {body}" for name, body in reversed(rules.items()))
