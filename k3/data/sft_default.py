"""The embedded chat set of ``k3 train --task sft`` (no ``--data``): conversations written for k3 and built here
from small tables, so fine-tuning works offline and the set is ours to ship (Apache-2.0 like the code).

It is a demonstration set, sized for a CPU run: 688 short, distinct conversations in OpenAI's message format, of
the kinds a chat model is tuned on: questions about Python with short code answers, small functions written to a
specification, arithmetic, word puzzles, an instruction in a system message, a follow-up turn, and tool calls
(a weather and a unit-conversion tool: the call, the tool's answer, the reply built from it). The same seed gives
the same conversations on every machine (``random.Random``, whose sequence Python keeps stable for a seed).
"""

from __future__ import annotations

import json
import random

SEED = 0

PYTHON_QA = [
    (
        "How do I read a file line by line in Python?",
        "Open it in a with block and iterate over the file object:\n\n```python\nwith open(path) as f:\n"
        "    for line in f:\n        print(line.rstrip())\n```",
    ),
    (
        "How do I check whether a key is in a dictionary?",
        "Use the in operator: `if key in d:`. To get a value with a fallback, use `d.get(key, default)`.",
    ),
    ("How do I reverse a list?", "Either in place with `items.reverse()`, or as a new list with `items[::-1]`."),
    (
        "What does the len function do?",
        "`len(x)` returns the number of items in a sequence or collection, for example `len([1, 2, 3])` is 3.",
    ),
    ("How do I join a list of strings with commas?", "Call join on the separator: `', '.join(words)`."),
    (
        "How do I sort a list of numbers in descending order?",
        "Use `sorted(numbers, reverse=True)` for a new list, or `numbers.sort(reverse=True)` in place.",
    ),
    ("How do I get the current working directory?", "Use `os.getcwd()`, or `pathlib.Path.cwd()`."),
    (
        "How do I remove duplicates from a list but keep the order?",
        "Use a dict, which keeps insertion order: `list(dict.fromkeys(items))`.",
    ),
    (
        "How do I write JSON to a file?",
        "Use json.dump:\n\n```python\nimport json\n\nwith open(path, 'w') as f:\n    json.dump(data, f)\n```",
    ),
    ("How do I read JSON from a string?", "Use `json.loads(text)`; it returns dicts, lists, strings and numbers."),
    (
        "How do I count how often each word appears?",
        "Use collections.Counter:\n\n```python\nfrom collections import Counter\n\ncounts = Counter(text.split())\n```",
    ),
    ("How do I make a list of the squares of 0 to 9?", "With a list comprehension: `[i * i for i in range(10)]`."),
    (
        "What is the difference between a list and a tuple?",
        "A list can be changed after it is made; a tuple cannot. Tuples can be dictionary keys, lists cannot.",
    ),
    (
        "How do I loop over a list with the index?",
        "Use enumerate:\n\n```python\nfor i, item in enumerate(items):\n    print(i, item)\n```",
    ),
    ("How do I loop over two lists together?", "Use zip:\n\n```python\nfor a, b in zip(xs, ys):\n    print(a, b)\n```"),
    (
        "How do I catch an exception?",
        "Wrap the code in try and name the exception:\n\n```python\ntry:\n    value = int(text)\n"
        "except ValueError:\n    value = 0\n```",
    ),
    ("How do I check the type of a value?", "Use `isinstance(value, int)`; it also accepts a tuple of types."),
    ("How do I split a string on whitespace?", "Call `text.split()` with no argument."),
    ("How do I get the last item of a list?", "Index it with -1: `items[-1]`."),
    ("How do I list the files in a directory?", "Use `os.listdir(path)`, or `sorted(pathlib.Path(path).iterdir())`."),
    ("How do I get the environment variable HOME?", "Use `os.environ.get('HOME')`, which gives None if it is unset."),
    (
        "How do I measure how long some code takes?",
        "Use time.perf_counter:\n\n```python\nimport time\n\nstart = time.perf_counter()\nwork()\n"
        "print(time.perf_counter() - start)\n```",
    ),
    ("How do I make a copy of a dictionary?", "Use `d.copy()` for a shallow copy, or `copy.deepcopy(d)`."),
    ("How do I turn a string into a number?", "Use `int(text)` for whole numbers and `float(text)` otherwise."),
    ("How do I format a float with two decimals?", "Use an f-string: `f'{value:.2f}'`."),
    ("How do I find the largest item in a list?", "Use `max(items)`; pass `key=` to compare by something else."),
    ("How do I merge two dictionaries?", "Use `a | b`; where both have a key, the value of b wins."),
    ("How do I create a directory and its parents?", "Use `os.makedirs(path, exist_ok=True)`."),
]

FUNCTIONS = [
    ("add", "a, b", "returns the sum of a and b", "return a + b"),
    ("square", "x", "returns x squared", "return x * x"),
    ("is_even", "n", "returns True if n is even", "return n % 2 == 0"),
    ("first", "items", "returns the first item of a list", "return items[0]"),
    ("last", "items", "returns the last item of a list", "return items[-1]"),
    ("average", "numbers", "returns the mean of a list of numbers", "return sum(numbers) / len(numbers)"),
    ("shout", "text", "returns the text in upper case", "return text.upper()"),
    ("reverse", "text", "returns the text reversed", "return text[::-1]"),
    ("count_vowels", "text", "counts the vowels in a string", "return sum(c in 'aeiou' for c in text.lower())"),
    ("largest", "numbers", "returns the largest number of a list", "return max(numbers)"),
    ("double_all", "numbers", "doubles every number of a list", "return [2 * n for n in numbers]"),
    ("is_empty", "items", "returns True if a list is empty", "return len(items) == 0"),
    ("word_count", "text", "counts the words in a string", "return len(text.split())"),
    ("clamp", "x, low, high", "limits x to the range from low to high", "return max(low, min(x, high))"),
    ("greet", "name", "returns a greeting for name", "return f'Hello, {name}!'"),
    ("cube", "x", "returns x cubed", "return x ** 3"),
    ("is_positive", "x", "returns True if x is greater than zero", "return x > 0"),
    ("evens", "numbers", "keeps the even numbers of a list", "return [n for n in numbers if n % 2 == 0]"),
    ("total_length", "words", "adds up the lengths of the words", "return sum(len(w) for w in words)"),
    ("swap", "a, b", "returns a and b swapped", "return b, a"),
]

WORDS = (
    "apple river window garden python stone cloud silver orange planet rabbit forest candle market pencil bridge "
    "yellow summer winter island castle dragon mirror rocket button guitar lemon tiger violet anchor harbor jungle "
    "copper marble meadow ribbon shadow temple valley wizard"
).split()

CITIES = (
    "Oslo Paris Lima Cairo Tokyo Nairobi Quito Berlin Madrid Rome Lisbon Dublin Vienna Prague Warsaw Athens Seoul "
    "Hanoi Manila Jakarta Sydney Auckland Toronto Denver Boston Chicago Havana Bogota Santiago Reykjavik"
).split()
SKIES = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowy")
SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a careful assistant that answers exactly.")

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERT_TOOL = {
    "type": "function",
    "function": {
        "name": "convert_units",
        "description": "Convert a length between units.",
        "parameters": {
            "type": "object",
            "properties": {"value": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
            "required": ["value", "from", "to"],
        },
    },
}
UNITS = {("km", "m"): 1000, ("m", "cm"): 100, ("kg", "g"): 1000, ("m", "mm"): 1000}


def _chat(user: str, answer: str, system: str | None = None) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": answer},
    ]
    return {"messages": messages}


def _arithmetic(rng: random.Random) -> dict:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    sign = {"+": "+", "-": "-", "*": "x"}[op]
    ask = rng.choice(["What is {a} {s} {b}?", "Compute {a} {s} {b}.", "{a} {s} {b} = ?"])
    return _chat(ask.format(a=a, s=sign, b=b), f"{a} {sign} {b} = {value}.")


def _word(rng: random.Random) -> dict:
    w = rng.choice(WORDS)
    kind = rng.randrange(4)
    if kind == 0:
        return _chat(f"Spell '{w}' backwards.", f"'{w}' backwards is '{w[::-1]}'.")
    if kind == 1:
        return _chat(f"How many letters are in '{w}'?", f"'{w}' has {len(w)} letters.")
    if kind == 2:
        return _chat(f"Write '{w}' in capital letters.", f"{w.upper()}")
    return _chat(f"What is the first letter of '{w}'?", f"The first letter of '{w}' is '{w[0]}'.")


def _function(i: int) -> dict:
    name, args, what, body = FUNCTIONS[i % len(FUNCTIONS)]
    ask = ["Write a Python function {n}({a}) that {w}.", "I need a function {n}({a}) that {w}."][
        i // len(FUNCTIONS) % 2
    ]
    code = f"```python\ndef {name}({args}):\n    {body}\n```"
    return _chat(ask.format(n=name, a=args, w=what), code)


def _weather(rng: random.Random, i: int) -> dict:
    city, sky, temp = rng.choice(CITIES), rng.choice(SKIES), rng.randint(-10, 35)
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    result = json.dumps({"city": city, "temperature_c": temp, "sky": sky})
    return {
        "tools": [WEATHER_TOOL, CONVERT_TOOL],
        "messages": [
            {
                "role": "user",
                "content": rng.choice(["What is the weather in {c}?", "Is it cold in {c} now?"]).format(c=city),
            },
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": result},
            {"role": "assistant", "content": f"It is {temp} degrees Celsius and {sky} in {city}."},
        ],
    }


def _convert(rng: random.Random, i: int) -> dict:
    (src, dst), factor = rng.choice(sorted(UNITS.items()))
    value = rng.randint(2, 50)
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "convert_units", "arguments": json.dumps({"value": value, "from": src, "to": dst})},
    }
    return {
        "tools": [WEATHER_TOOL, CONVERT_TOOL],
        "messages": [
            {"role": "user", "content": f"How many {dst} are {value} {src}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": json.dumps({"value": value * factor})},
            {"role": "assistant", "content": f"{value} {src} is {value * factor} {dst}."},
        ],
    }


def _follow_up(rng: random.Random) -> dict:
    first = _word(rng)["messages"]
    second = _arithmetic(rng)["messages"]
    hello = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"}]
    return {"messages": hello + first + second if rng.random() < 0.5 else first + second}


def _with_system(rng: random.Random) -> dict:
    chat = _arithmetic(rng) if rng.random() < 0.5 else _word(rng)
    chat["messages"].insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
    return chat


# conversations of each kind (the tables bound how many distinct ones some kinds have)
COUNTS = {
    "qa": len(PYTHON_QA),
    "function": 2 * len(FUNCTIONS),
    "word": 120,
    "arithmetic": 220,
    "tool": 120,
    "follow_up": 80,
    "system": 80,
}


def conversations(seed: int = SEED) -> list[dict]:
    """The set: ``{"messages": [...]}`` records (tool calls with ``"tools"``), each distinct, in a seeded order."""
    rng = random.Random(seed)
    makers = {
        "qa": lambda i: _chat(*PYTHON_QA[i], rng.choice((None,) + SYSTEMS)),
        "function": _function,
        "word": lambda i: _word(rng),
        "arithmetic": lambda i: _arithmetic(rng),
        "tool": lambda i: _weather(rng, i) if i % 3 else _convert(rng, i),
        "follow_up": lambda i: _follow_up(rng),
        "system": lambda i: _with_system(rng),
    }
    out, seen = [], set()
    for kind, count in COUNTS.items():
        made = 0
        for i in range(50 * count):  # draws until `count` distinct ones (bounded: a small table runs out)
            chat = makers[kind](i)
            key = json.dumps(chat, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(chat)
                made += 1
                if made == count:
                    break
    rng.shuffle(out)
    return out
