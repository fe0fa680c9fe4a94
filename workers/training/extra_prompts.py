"""More self-distillation prompts, written by us, for a drafter that generalises beyond the few
thousand prompts of :mod:`workers.training.prompt_sources`.

* ``chat``: further instruction templates crossed with further topics.
* ``math``: grade-school word problems from templates with random quantities (GSM8K-like in form;
  no dataset text).
* ``code``: functions and methods from many pure-Python standard-library modules, asked about in
  several ways (explain, continue, document, test, complete a stub from its signature and
  docstring).

Every prompt gets a split from the same stable hash as the base sources
(:func:`workers.training.prompt_sources.split_of`); training uses only ``train`` prompts.
"""

from __future__ import annotations

import importlib
import inspect
import random

from workers.training.prompt_sources import CHAT_TEMPLATES, TOPICS, _chat

EXTRA_CHAT_TEMPLATES = [
    "Write a persuasive paragraph about why people should care about {t}.",
    "List ten interesting facts about {t}.",
    "Write a dialogue between two friends discussing {t}.",
    "Explain {t} in exactly three sentences.",
    "What questions would a journalist ask an expert on {t}? Give eight.",
    "Write a poem with four stanzas about {t}.",
    "Create a lesson plan for teaching {t} to high school students.",
    "Write a news article about a surprising discovery involving {t}.",
    "How has {t} changed over the last hundred years?",
    "Give me a quiz with five multiple-choice questions about {t}, with answers.",
    "Write a blog post introduction about {t}.",
    "What would the world look like without {t}?",
    "Describe {t} using only simple words.",
    "Write a motivational speech that mentions {t}.",
    "Outline an essay about {t}.",
    "Tell me a joke about {t} and explain why it is funny.",
    "Write a diary entry from the point of view of someone discovering {t}.",
    "What are the most important terms to know about {t}? Define each one.",
]
EXTRA_TOPICS = [
    "volunteering", "the stock market", "renewable energy", "wind turbines", "the human brain",
    "bacteria", "the immune system", "jazz", "classical music", "the guitar", "knitting", "yoga",
    "the French Revolution", "the Industrial Revolution", "the Great Wall of China", "pyramids",
    "submarines", "rockets", "satellites", "Mars", "comets", "the periodic table", "magnets",
    "electricity", "rainbows", "clouds", "hurricanes", "glaciers", "coral reefs", "whales", "owls",
    "elephants", "penguins", "ants", "mushrooms", "tomatoes", "chocolate", "cheese", "rice",
    "recipes for soup", "a birthday party", "moving to a new city", "learning to swim",
    "starting a small business", "saving money", "open source software", "password security",
    "spreadsheets", "email etiquette", "remote work", "team meetings", "note taking",
    "reading books", "poetry", "theater", "film making", "comic books", "board games", "soccer",
    "basketball", "tennis", "the Tour de France", "city parks", "skyscrapers", "bridges",
    "a haunted house", "a dragon who is afraid of the dark", "a robot learning to cook",
    "a time traveler", "a small town festival", "a lost kitten", "an old map",
]

# (template, answer function) pairs; quantities drawn per prompt.
_NAMES = ["Maria", "James", "Aisha", "Tom", "Lena", "Carlos", "Mei", "Omar", "Sofia", "Ravi", "Emma", "Noah"]
_ITEMS = ["apples", "stickers", "marbles", "books", "pencils", "cookies", "cards", "shells", "stamps", "eggs"]
MATH_TEMPLATES = [
    "{n} has {a} {i}. {n} buys {b} more and then gives {c} to a friend. How many {i} does {n} have now?",
    "A box holds {a} {i}. {n} fills {b} boxes and has {c} {i} left over. How many {i} are there in total?",
    "{n} earns ${a} per hour and works {b} hours a day for {c} days. How much money does {n} earn?",
    "A train travels at {a} miles per hour for {b} hours, then at {c} miles per hour for 2 hours. "
    "How far does it travel in total?",
    "{n} reads {a} pages on Monday, twice as many on Tuesday, and {b} pages on Wednesday. "
    "The book has {c} pages in total. How many pages are left?",
    "A store sells {i} for ${a} each. {n} buys {b} of them and pays with a ${c} bill. "
    "How much change does {n} get?",
    "There are {a} students in a class. {b} percent of them walk to school and the rest take the bus. "
    "How many students take the bus?",
    "{n} saves ${a} every week. After {b} weeks {n} spends ${c} on a gift. How much money is left?",
    "A garden has {a} rows with {b} plants in each row. {c} plants die. How many plants are left?",
    "{n} has {a} {i} and shares them equally among {b} friends, keeping the remainder. "
    "How many does each friend get and how many does {n} keep?",
    "A recipe needs {a} cups of flour for {b} cookies. How many cups of flour are needed for {c} cookies?",
    "The temperature was {a} degrees in the morning, rose by {b} degrees by noon and fell by {c} degrees "
    "by night. What was the temperature at night?",
]


def extra_chat_prompts() -> list[dict]:
    templates = EXTRA_CHAT_TEMPLATES
    out = [_chat(t.format(t=topic), "chat") for t in templates for topic in EXTRA_TOPICS]
    # Old templates with new topics as well (held-out chat prompts are old template x old topic).
    out += [_chat(t.format(t=topic), "chat") for t in CHAT_TEMPLATES for topic in EXTRA_TOPICS]
    out += [_chat(t.format(t=topic), "chat") for t in templates for topic in TOPICS]
    return out


def math_prompts(n: int = 1200, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        t = MATH_TEMPLATES[k % len(MATH_TEMPLATES)]
        q = t.format(n=rng.choice(_NAMES), i=rng.choice(_ITEMS), a=rng.randint(3, 60), b=rng.randint(2, 25),
                     c=rng.randint(2, 90))
        out.append(_chat(q + "\nSolve step by step.", "math"))
    return out


STDLIB_MODULES = [
    "argparse", "ast", "base64", "bisect", "calendar", "configparser", "copy", "csv", "dataclasses",
    "difflib", "email.utils", "enum", "fnmatch", "fractions", "ftplib", "functools", "genericpath",
    "getopt", "glob", "gzip", "heapq", "html", "http.cookies", "imaplib", "inspect", "ipaddress",
    "json.decoder", "json.encoder", "locale", "logging", "mimetypes", "ntpath", "numbers", "operator",
    "optparse", "os", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "posixpath", "pprint",
    "queue", "quopri", "random", "reprlib", "sched", "secrets", "selectors", "shlex", "shutil",
    "smtplib", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "traceback", "typing", "urllib.parse", "urllib.request", "uu",
    "uuid", "warnings", "weakref", "webbrowser", "zipfile", "zipimport",
]
_CODE_ASKS = [
    "Explain what this Python function does:\n\n{src}",
    "Continue this Python code:\n\n{head}",
    "Write a docstring for this Python function:\n\n{src}",
    "Write three pytest unit tests for this Python function:\n\n{src}",
    "Complete this Python function:\n\n{stub}",
    "Is there a bug or an edge case in this Python function? Explain.\n\n{src}",
]


def _stdlib_functions() -> list[tuple[str, str]]:
    """``(source, stub)`` for public functions and methods of :data:`STDLIB_MODULES`."""
    seen, out = set(), []
    for name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - modules removed from newer Pythons are skipped
            continue
        members = [o for _, o in inspect.getmembers(mod, inspect.isfunction) if o.__module__ == mod.__name__]
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == mod.__name__:
                members += [o for _, o in inspect.getmembers(cls, inspect.isfunction)
                            if getattr(o, "__module__", None) == mod.__name__]
        for obj in members:
            try:
                src = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            if not 200 < len(src) < 1500 or src in seen:
                continue
            seen.add(src)
            body = inspect.cleandoc(src).split("\n")
            doc = inspect.getdoc(obj)
            stub = body[0] + ("\n    " + '"""' + doc.split("\n\n")[0] + '"""\n' if doc else "\n")
            out.append((inspect.cleandoc(src), stub))
    return out


def code_prompts(limit: int = 2000, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    funcs = _stdlib_functions()
    rng.shuffle(funcs)
    out = []
    for k, (src, stub) in enumerate(funcs[:limit]):
        ask = _CODE_ASKS[k % len(_CODE_ASKS)]
        out.append(_chat(ask.format(src=src, head=src[: max(80, len(src) // 3)], stub=stub), "code"))
    return out


def extra_prompts() -> list[dict]:
    """All extra prompts (both splits, no duplicate texts), interleaved by a fixed shuffle."""
    prompts = extra_chat_prompts() + math_prompts() + code_prompts()
    random.Random(2).shuffle(prompts)
    seen: set[str] = set()
    unique = []
    for p in prompts:
        text = p["messages"][0]["content"]
        if text not in seen:
            seen.add(text)
            unique.append(p)
    return unique
