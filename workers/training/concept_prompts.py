"""Short-generation prompts, written by us: a sentence from a set of concepts, a sentence about a
topic, the concepts of a sentence, and app or product reviews.

The ``generation`` category of ``broad/train.jsonl`` has only 216 prompts (sentence-from-concepts
and review tasks), too few to teach the drafter the short, plain answers such tasks get; these
templates cross our own word lists and phrasings into many more of the same kind. Every prompt gets
a split from :func:`workers.training.prompt_sources.split_of`; training uses only ``train`` ones.
"""

from __future__ import annotations

import random

from workers.training.prompt_sources import _chat, split_of

NOUNS = [
    "dog", "cat", "horse", "bird", "fish", "cow", "sheep", "farmer", "field", "tractor", "river",
    "boat", "bridge", "tree", "leaf", "flower", "garden", "fence", "road", "car", "bus", "train",
    "station", "ticket", "city", "street", "shop", "market", "bread", "cheese", "apple", "orange",
    "kitchen", "table", "chair", "window", "door", "roof", "house", "room", "bed", "pillow", "book",
    "library", "student", "teacher", "classroom", "board", "pencil", "paper", "computer", "phone",
    "camera", "picture", "wall", "brush", "artist", "music", "guitar", "piano", "song",
    "stage", "crowd", "ball", "team", "player", "goal", "court", "net", "racket", "bike",
    "helmet", "mountain", "snow", "ski", "lake", "beach", "wave", "sand", "sun", "cloud", "rain",
    "umbrella", "coat", "shoe", "hat", "mirror", "hair", "water", "glass", "cup", "coffee", "tea",
    "plate", "knife", "fork", "soup", "pot", "stove", "oven", "cake", "candle", "birthday", "gift",
    "child", "baby", "mother", "father", "friend", "doctor", "nurse", "hospital", "police", "fire",
    "smoke", "truck", "plane", "airport", "pilot", "map", "bag", "wallet", "key", "lock", "box",
    "floor", "carpet", "rug", "blanket", "couch", "television", "newspaper", "letter", "stamp",
    "office", "desk", "meeting", "chef", "restaurant", "menu", "waiter", "park", "bench", "path",
    "grass", "hill", "forest", "tent", "camp", "rope", "dress", "wedding", "church", "bell", "clock",
]
VERBS = [
    "run", "walk", "jump", "sit", "stand", "ride", "drive", "pull", "push", "throw", "catch", "kick",
    "hold", "carry", "open", "close", "read", "write", "draw", "paint", "sing", "dance", "play",
    "cook", "cut", "eat", "drink", "pour", "wash", "clean", "fix", "build", "climb", "swim", "fly",
    "watch", "look", "listen", "talk", "laugh", "smile", "wait", "sleep", "wear", "buy", "sell",
    "pack", "plant", "grow", "pick", "feed", "teach", "learn", "perform", "hang", "fold", "lay",
]
CONCEPT_TEMPLATES = [
    "Write one sentence that uses all of these words: {c}.",
    "Make a sentence containing the concepts {c}.",
    "Here are some concepts: {c}. Write a sentence that includes all of them.",
    "Combine the words {c} into one natural sentence.",
    "Using the concepts {c}, describe an everyday scene in one sentence.",
    "Concepts: {c}\nWrite a short sentence about them:",
    "Create a sentence with the following words, in any order: {c}.",
    "Which sentence could describe a picture showing {c}? Write it.",
]
TOPIC_TEMPLATES = [
    "Write a sentence about {n}.",
    "Give me one sentence on the topic of {n}.",
    "Tell me something about {n} in a single sentence.",
]
SENTENCE_TEMPLATES = [
    "What are the main concepts in this sentence? {s}",
    "List the key words of the following sentence: {s}",
    "Which topics does this sentence mention? {s}",
    "Extract the concepts from the sentence: {s}",
]
REVIEW_TEMPLATES = [
    "Write a {k}-star review (out of 5) of the app with package {pkg}.",
    "Generate a {k}-star review for the app {pkg}, where 1 is the lowest and 5 the highest.",
    "Write a short {k}-star customer review of a {product}.",
    "Pretend you bought a {product}. Write a review giving it {k} stars out of 5.",
]
_VENDORS = ["acme", "brightsoft", "nordapps", "pixelworks", "bluefin", "greenleaf", "zenlabs", "orbit"]
_APPS = ["notes", "weather", "radio", "scanner", "calendar", "tracker", "keyboard", "launcher", "player",
         "browser", "gallery", "fitness", "budget", "translator", "recorder", "flashlight"]
_PRODUCTS = ["coffee maker", "pair of running shoes", "backpack", "desk lamp", "blender", "phone case",
             "winter jacket", "electric kettle", "board game", "set of headphones", "vacuum cleaner",
             "cookbook", "water bottle", "office chair", "toaster", "garden hose"]


def _sentence(rng: random.Random) -> str:
    """A simple everyday sentence from the word lists (its concepts are the nouns and verb)."""
    a, b = rng.sample(NOUNS, 2)
    v = rng.choice(VERBS)
    forms = [f"The {a} likes to {v} near the {b}.", f"The {a} and the {b} {v} together in the morning.",
             f"We watched the {a} {v} next to the old {b}.", f"Every day the {a} tries to {v} by the {b}."]
    return rng.choice(forms)


def concept_prompts(n: int = 2000, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` prompts (category ``generation``) of the chosen ``split``, no duplicate texts.

    Raises:
        ValueError: ``split`` is not ``train`` or ``heldout``.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict] = []
    kinds = ["concepts"] * 5 + ["topic", "sentence", "review"]
    for _ in range(50 * n):
        if len(out) >= n:
            break
        kind = rng.choice(kinds)
        if kind == "concepts":
            words = rng.sample(NOUNS, rng.randint(1, 3)) + rng.sample(VERBS, 1)
            rng.shuffle(words)
            text = rng.choice(CONCEPT_TEMPLATES).format(c=", ".join(words))
        elif kind == "topic":
            text = rng.choice(TOPIC_TEMPLATES).format(n=rng.choice(["the " + w for w in NOUNS]))
        elif kind == "sentence":
            text = rng.choice(SENTENCE_TEMPLATES).format(s=_sentence(rng))
        else:
            pkg = f"com.{rng.choice(_VENDORS)}.{rng.choice(_APPS)}"
            text = rng.choice(REVIEW_TEMPLATES).format(k=rng.randint(1, 5), pkg=pkg, product=rng.choice(_PRODUCTS))
        if text not in seen and split_of(text) == split:
            seen.add(text)
            out.append(_chat(text, "generation"))
    return out
