"""The benchmarks' prompts, by name: the sets each benchmark runs, drawn from the one registry
(localspec.bench.prompts, which `localspec bench` shares), the grounded prompts only the replays
use, the chat turns of the chat tables, and the document the document questions are asked about.

Which prompts a benchmark runs is a tuple of names; its texts come from here, so every table
of the same prompt name was measured on the same text.
"""

from __future__ import annotations

from pathlib import Path

from localspec.bench.prompts import PROMPTS as NAMED

HEAD_TO_HEAD_NAMES = ("code", "prose", "code-edit", "summarise")
PROMPTS = {name: NAMED[name] for name in HEAD_TO_HEAD_NAMES}  # head_to_head's (and the A/B's)
GROUNDED = ("code-edit", "summarise")  # input-grounded prompts of PROMPTS: the answer repeats the prompt
WHOLE_PROCESS = {**PROMPTS, "rename": NAMED["rename"]}  # whole_process's (and distributed's, the replays')
GROUNDED_PROMPTS = (*GROUNDED, "rename")

_CODE = ('def parse_config(path):\n    result = {}\n    with open(path) as handle:\n        for line in handle:\n'
         '            line = line.strip()\n            if not line or line.startswith("#"):\n                continue\n'
         '            key, value = line.split("=", 1)\n            result[key.strip()] = value.strip()\n'
         '    return result\n')
_TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes planned for the river district. "
         "Residents raised concerns about parking, while shop owners said more cyclists would bring more "
         "customers. The council agreed to run a six-month trial on two streets before deciding on the full "
         "plan, and asked the transport office to publish traffic counts every month.")
HELD_OUT = {  # grounded prompts that no planner setting was tuned on
    "hints": "Add type hints to this function and show the whole code:\n\n" + _CODE,
    "rename2": "Rename `handle` to `config_file` in this code and show the whole code:\n\n" + _CODE,
    "docstring": "Add a docstring to this function and show the whole code:\n\n" + _CODE,
    "bugfix": "This function crashes on lines without '='. Fix it and show the whole code:\n\n" + _CODE,
    "quote": "Quote the sentence about the trial from this text, then explain it in one sentence:\n\n" + _TEXT,
    "summarise2": "Summarise this paragraph in two sentences:\n\n" + _TEXT,
}
_JS = ("function totalPrice(items, taxRate) {\n  let total = 0;\n  for (const item of items) {\n"
       "    if (item.quantity <= 0) {\n      continue;\n    }\n    total += item.price * item.quantity;\n  }\n"
       "  const tax = total * taxRate;\n  return Math.round((total + tax) * 100) / 100;\n}\n")
_CLASS = ("class Inventory:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, name, count):\n"
          "        if name in self.items:\n            self.items[name] += count\n        else:\n"
          "            self.items[name] = count\n\n    def remove(self, name, count):\n"
          "        if name not in self.items:\n            raise KeyError(name)\n        self.items[name] -= count\n"
          "        if self.items[name] <= 0:\n            del self.items[name]\n")
_NOTICE = ("The library will close for renovation from the first of March until the end of May. During this time, "
           "members can borrow books from the mobile library that will visit the town square every Saturday "
           "morning. Returns can be made at the post office. The renovated building will have a larger children's "
           "section, a quiet study room and new computers for public use.")
_REVIEW = ("Our team tested three coffee machines over two weeks. The cheapest machine made good coffee but was "
           "loud and hard to clean. The mid-range machine was quiet and easy to clean, and its coffee was the best "
           "of the three. The most expensive machine had many features that nobody used, and it broke down twice.")
MORE = {  # a second set of grounded prompts: other code, other languages, other kinds of prose work
    "js-rename": "Rename `total` to `subtotal` in this JavaScript function and show the whole code:\n\n" + _JS,
    "js-comments": "Add a short comment above each line of this function and show the whole code:\n\n" + _JS,
    "class-hints": "Add type hints to this class and show the whole code:\n\n" + _CLASS,
    "class-rename": "Rename the method `remove` to `take` in this class and show the whole code:\n\n" + _CLASS,
    "class-method": ("Add a method `count(name)` that returns the count of an item (0 if missing) to this class "
                     "and show the whole class:\n\n" + _CLASS),
    "class-error": ("Rewrite this class to raise a ValueError with a helpful message instead of KeyError, and "
                    "show the whole code:\n\n" + _CLASS),
    "sum-notice": "Summarise this notice in two sentences:\n\n" + _NOTICE,
    "sum-review": "Summarise this review in one paragraph:\n\n" + _REVIEW,
    "quote-notice": ("Quote the sentence about returns from this notice, then say where the mobile library will "
                     "be:\n\n" + _NOTICE),
    "typos": "Fix the typos in this text and show the whole corrected text:\n\n" + _REVIEW.replace(
        "machines", "machnes").replace("clean", "claen").replace("features", "featuers"),
    "bullets": "Turn this notice into a bulleted list, keeping the wording:\n\n" + _NOTICE,
    "extract": "List every machine mentioned in this review with what the text says about it:\n\n" + _REVIEW,
}
_GO = ("func countWords(lines []string) map[string]int {\n\tcounts := make(map[string]int)\n"
       "\tfor _, line := range lines {\n\t\tfor _, word := range strings.Fields(line) {\n"
       "\t\t\tword = strings.ToLower(word)\n\t\t\tcounts[word]++\n\t\t}\n\t}\n\treturn counts\n}\n")
_SQL = ("SELECT customers.name, orders.total\nFROM customers\nJOIN orders ON orders.customer_id = customers.id\n"
        "WHERE orders.created_at >= '2024-01-01'\nORDER BY orders.total DESC\nLIMIT 10;\n")
_EMAIL = ("Hi Sam, thanks for sending the draft contract. Legal has two changes: the payment term should be 30 "
          "days instead of 45, and the notice period for ending the contract should be three months. Could you "
          "send an updated version by Friday? We would like to sign it at the meeting on the 14th. Best, Ana")
_CONFIG = ('{"server": {"host": "localhost", "port": 8080, "workers": 4}, "database": {"url": '
           '"postgres://db/app", "pool": 10}, "logging": {"level": "info", "file": "app.log"}}')
HELD_BACK = {  # the held-back set: grounded prompts written before the planner's tuning, never changed
    "go-rename": "Rename `counts` to `frequencies` in this Go function and show the whole code:\n\n" + _GO,
    "go-comment": "Add a doc comment to this Go function and show the whole code:\n\n" + _GO,
    "sql-alias": "Rewrite this SQL query with the table aliases c and o and show the whole query:\n\n" + _SQL,
    "sql-limit": "Change this query to return the top 25 rows and show the whole query:\n\n" + _SQL,
    "email-points": "List the requested changes in this email as bullet points:\n\n" + _EMAIL,
    "email-reply": "Write a short reply to this email that repeats the two changes:\n\n" + _EMAIL,
    "json-pretty": "Format this JSON with two-space indentation:\n\n" + _CONFIG,
    "json-port": "Change the port to 9090 in this JSON and show the whole JSON:\n\n" + _CONFIG,
}
REPLAY_PROMPTS = {**WHOLE_PROCESS, **HELD_OUT, **MORE, **HELD_BACK}
REPLAY_GROUNDED = (*GROUNDED_PROMPTS, *HELD_OUT, *MORE, *HELD_BACK)

CHAT_TURNS = (  # whole_process's 5-turn chat
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Add type hints to it and show the whole function.",
    "Rename the loop variable to `step` and show the whole function again.",
    "Add a docstring and show the whole function.",
    "Write a pytest test for it.",
)
SAVED_CHAT_TURNS = ("Write a Python function that returns the n-th Fibonacci number iteratively.",  # prompt_cache's
                    "Add type hints to it.", "Add a docstring.", "Rename the loop variable to `step`.",
                    "Write a pytest test for it.")
RESUMED = "Now make it return a list of the first n numbers."  # asked of the saved chat in a new process
QUESTIONS = ("What does Engine.step return? Answer in one sentence.",  # about the document
             "Which class holds the running statistics of a generation? Answer in one sentence.",
             "What does GenerationStats.block_efficiency measure? Answer in one sentence.")


def document(chars: int) -> str:
    """The benchmarks' document: the start of localspec's engine source (~4.3 characters a token)."""
    import localspec.decoding.engine as engine

    return Path(engine.__file__).read_text(encoding="utf-8")[:chars]
