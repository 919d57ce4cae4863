"""Built-in training prompts: chat, code and math, made on the spot so no download is needed.

A drafter learns the target's own replies, so what matters is that the prompts lead the target
through the kinds of text it will be asked for, not that they are clever. Three sources, mixed
in equal parts and seeded:

- code: functions of Python's standard library, asked for from their signature and docstring
  (the text every Python install carries), and everyday tasks in several languages;
- math: word problems and equations from templates with drawn numbers;
- chat: explanations, advice, writing and comparisons over lists of everyday topics.

None of them is a prompt of the evaluation sets (``bench``'s built-in prompts, HumanEval):
``synthetic_prompts`` drops any that would be.
"""

from __future__ import annotations

import importlib
import inspect
import json
from importlib import resources

import numpy as np

from ..errors import DFlashError

_MODULES = ("string", "textwrap", "statistics", "heapq", "bisect", "fnmatch", "difflib", "calendar", "colorsys",
            "html", "base64", "shlex", "posixpath", "glob", "csv", "ipaddress", "fractions", "random", "json",
            "itertools", "functools", "operator", "collections", "shutil", "urllib.parse", "zlib", "math",
            "copy", "pprint", "keyword", "secrets", "uuid", "hashlib", "datetime", "re", "gzip", "tempfile",
            "os.path", "ntpath", "decimal", "numbers", "cmath", "locale", "gettext",
            "mimetypes", "quopri", "binascii", "struct", "codecs", "unicodedata", "stringprep", "email.utils",
            "http.cookies", "urllib.request", "wsgiref.util", "xml.sax.saxutils", "configparser", "netrc",
            "platform", "sysconfig", "getpass", "linecache", "tokenize", "ast", "dis", "inspect", "pydoc",
            "zipfile", "tarfile", "filecmp", "fileinput", "stat", "reprlib", "enum", "graphlib", "weakref",
            "types", "contextlib", "abc", "traceback", "warnings", "timeit", "sched", "queue", "threading",
            "subprocess", "socket", "selectors", "logging", "argparse", "getopt", "optparse", "pathlib")

_TASKS = (
    "removes duplicate items from a list while keeping their order", "counts the words in a text file",
    "merges two sorted lists into one sorted list", "finds the second largest number in a list",
    "converts a temperature from Celsius to Fahrenheit", "checks whether a year is a leap year",
    "flattens a nested list", "returns the most common character in a string",
    "rotates a matrix by 90 degrees", "validates an email address with a regular expression",
    "computes the greatest common divisor of two numbers", "splits a list into chunks of a given size",
    "reads a JSON file and prints its keys", "checks whether two strings are anagrams",
    "finds all prime numbers below a limit", "capitalises the first letter of every word",
    "computes the running average of a stream of numbers", "parses a date string and returns the weekday",
    "finds the longest common prefix of a list of strings", "converts a Roman numeral to an integer",
    "implements a stack with push, pop and peek", "implements a queue using two stacks",
    "returns the n-th row of Pascal's triangle", "counts the vowels in a sentence",
    "finds the missing number in a list of 1 to n", "transposes a CSV file",
    "implements bubble sort", "implements merge sort", "implements quicksort",
    "checks whether parentheses in a string are balanced", "converts a decimal number to binary",
    "computes the factorial of a number recursively", "sums the digits of an integer",
    "returns the intersection of two lists", "groups a list of words by their first letter",
    "finds the shortest path in an unweighted graph with breadth-first search",
    "memoises a slow function", "retries a function call up to three times",
    "walks a directory tree and lists files larger than 1 MB", "compresses a string with run-length encoding",
    "reverses the words of a sentence", "checks whether a string is a palindrome", "implements binary search",
    "counts how often each word appears in a text", "generates the first n Fibonacci numbers",
    "converts a string to title case without a library", "finds the longest increasing subsequence",
    "computes the Levenshtein distance of two strings", "implements a linked list with insert and delete",
    "implements a least-recently-used cache", "parses a query string into a dictionary",
    "formats a number of bytes as KB, MB or GB", "checks whether a number is prime",
    "finds duplicate files in a folder by their hash", "computes the median of an unsorted list",
    "shuffles a list with the Fisher-Yates algorithm", "converts snake_case names to camelCase",
    "implements a binary search tree with insert and search", "counts the lines of code in a project",
    "sorts a list of dictionaries by a key", "finds the k largest elements of a list with a heap",
    "implements a rate limiter", "computes the dot product of two vectors", "multiplies two matrices",
    "detects a cycle in a linked list", "evaluates a postfix expression", "converts a hex colour to RGB",
    "validates a Sudoku board", "solves the N-queens problem", "implements depth-first search on a graph",
    "finds all permutations of a string", "computes the power set of a set", "reads environment variables "
    "with defaults", "downloads a web page and counts its links", "implements a simple tokenizer for arithmetic",
    "builds a histogram of word lengths", "implements a trie for word lookup", "debounces a function",
    "computes compound interest over several years", "checks whether a binary tree is balanced",
)
_LANGUAGES = ("Python", "Python", "Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "Ruby",
              "bash")

_MATH = (
    "A shop sells pencils at {a} cents each. How much do {b} pencils cost in dollars?",
    "A car travels {a} km in {b} hours. What is its average speed?",
    "Tom has {a} marbles. He gives {b} to his sister and buys {c} more. How many marbles does he have now?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "Solve for y: {a}y - {b} = {c}. Show your work.",
    "What is {a}% of {c}?",
    "A recipe needs {a} eggs for {b} people. How many eggs are needed for {c} people?",
    "A tank holds {c} litres and drains at {a} litres per minute. How long until it is empty?",
    "Find the mean and the median of {a}, {b}, {c}, {d} and {e}.",
    "A worker earns ${a} an hour and works {b} hours a week. How much does she earn in {d} weeks?",
    "What is the sum of the integers from 1 to {c}?",
    "A bag has {a} red and {b} blue balls. What is the probability of drawing a red ball?",
    "Simplify the fraction {a}/{c}.",
    "A jacket costs ${c}. It is on sale for {a}% off. What is the sale price?",
    "Compute {a} x {b} + {c} step by step.",
    "If {a} workers build a wall in {b} days, how long do {d} workers take at the same rate?",
    "Convert {c} minutes into hours and minutes.",
    "The angles of a triangle are {a} and {b} degrees. What is the third angle?",
    "Expand and simplify ({a}x + {b})({b}x - {d}).",
    "A train leaves at {a}:15 and the trip takes {b} hours {d} minutes. When does it arrive?",
)

_CHAT = (
    ("Explain {t} in simple terms.", "concepts"), ("What is {t}, and why does it matter?", "concepts"),
    ("Give me five tips for {t}.", "activities"), ("What are common mistakes people make when {t}?", "activities"),
    ("Write a short poem about {t}.", "things"), ("Write a friendly email inviting a colleague to {t}.", "events"),
    ("Describe {t} to someone who has never seen it.", "things"), ("Plan a one-day schedule for {t}.", "events"),
    ("What are the pros and cons of {t}?", "choices"), ("Summarise the history of {t} in a paragraph.", "things"),
    ("How would you explain {t} to a ten-year-old?", "concepts"), ("Write a short story that involves {t}.", "things"),
    ("I want to get better at {t}. Where should I start?", "activities"),
    ("Write a checklist for {t}.", "events"), ("Should I choose {t}? Help me decide.", "choices"),
    ("What are three surprising facts about {t}?", "things"), ("Write a short speech to open {t}.", "events"),
    ("What questions should I ask before {t}?", "activities"), ("Write an analogy that explains {t}.", "concepts"),
    ("Write a short dialogue between two friends arguing about {t}.", "choices"),
    ("What is the difference between {t} and the ideas people confuse it with?", "concepts"),
    ("Write a quiz of five questions about {t}, with answers.", "concepts"),
    ("Make a weekly plan for {t}.", "activities"), ("What gear or tools do I need for {t}?", "activities"),
    ("Write a haiku about {t}.", "things"), ("Write a product description for a poster of {t}.", "things"),
    ("Write an agenda for {t}.", "events"), ("Write a thank-you note after {t}.", "events"),
    ("Argue for and against {t} in two short paragraphs.", "choices"),
    ("What do experts say about {t}?", "choices"),
)
_TOPICS = {
    "concepts": ("inflation", "machine learning", "the water cycle", "compound interest", "gravity", "democracy",
                 "photosynthesis in plants", "vaccines", "the internet", "climate change", "supply and demand",
                 "plate tectonics", "encryption", "evolution", "the immune system", "renewable energy",
                 "a budget", "recursion", "blockchains", "the stock market", "sleep cycles", "electricity",
                 "black holes", "interest rates", "natural selection", "the greenhouse effect", "probability",
                 "opportunity cost", "antibiotics", "DNA", "nuclear fusion", "the scientific method", "taxes",
                 "version control", "operating systems", "neural networks", "ocean tides", "the placebo effect",
                 "game theory", "entropy", "the Doppler effect", "cloud computing", "habit formation",
                 "exchange rates", "memory in the brain", "earthquakes"),
    "activities": ("learning a new language", "running a first marathon", "saving money", "cooking rice",
                   "writing a CV", "public speaking", "growing tomatoes", "travelling on a budget",
                   "studying for exams", "moving to a new city", "training a puppy", "starting a podcast",
                   "keeping a journal", "learning the guitar", "taking better photos", "hiking in the mountains",
                   "learning to code", "baking sourdough bread", "painting with watercolours", "negotiating a salary",
                   "making new friends as an adult", "meditating", "learning to swim", "decluttering a home",
                   "preparing for a job interview", "writing a novel", "camping with children", "running a meeting",
                   "managing stress", "learning chess", "renovating a kitchen", "starting a small business"),
    "things": ("the ocean", "a thunderstorm", "a city at night", "the moon", "coffee", "bicycles", "libraries",
               "the printing press", "chess", "the violin", "a desert", "trains", "bread", "autumn leaves",
               "a lighthouse", "the rainforest", "a volcano", "old maps", "snow", "a street market", "jazz",
               "the telescope", "a garden in spring", "bees", "the Great Wall of China", "paper money",
               "a mountain lake", "clocks", "the first computers", "tea", "rivers", "a harbour at dawn"),
    "events": ("a team lunch", "a birthday party", "a book club meeting", "a charity run", "a science fair",
               "a product launch", "a picnic in the park", "a weekend in Paris", "a board game night",
               "a wedding anniversary dinner", "a school reunion", "a hackathon", "a farewell party",
               "a neighbourhood clean-up", "a family camping trip", "a job fair", "a charity bake sale",
               "a team retreat", "a graduation ceremony", "a cooking class", "a museum visit with children"),
    "choices": ("working from home", "electric cars", "living in a big city", "online learning", "social media",
                "renting versus buying a home", "a four-day work week", "nuclear power", "remote meetings",
                "homeschooling", "a gap year", "vegetarian diets", "public transport", "freelancing",
                "smartphones for children", "self-driving cars", "universal basic income", "open-plan offices",
                "studying abroad", "paper books versus e-books", "owning a pet", "early retirement"),
}


def _docstring_prompts() -> list[str]:
    """'Write a Python function `f(args)` that ...' for documented functions of the standard library."""
    out = []
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr, fn in sorted(vars(module).items()):
            if attr.startswith("_") or not callable(fn) or getattr(fn, "__module__", None) != module.__name__:
                continue
            doc = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ").strip()
            if len(doc) < 30 or inspect.isclass(fn):
                continue
            try:
                signature = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            if "<" in signature:  # a default shown as an object's repr: the names alone read better
                signature = f"({', '.join(inspect.signature(fn).parameters)})"
            out.append(f"Write a Python function `{attr}{signature}` that does this: {doc}")
    return out


def _evaluation_prompts() -> set[str]:
    sets = json.loads(resources.files("dflash_mlx").joinpath("data/prompts.json").read_text())
    return {p.strip() for prompts in sets.values() for p in prompts}


def synthetic_prompts(count: int, seed: int = 0) -> list[str]:
    """``count`` prompts, a third each of code, math and chat (see the module doc), in a seeded order."""
    rng = np.random.default_rng(seed)
    code = _docstring_prompts()
    code = list(dict.fromkeys(code + [f"Write a {lang} function that {task}." for task in _TASKS for lang in _LANGUAGES]))
    chat = [template.format(t=t) for template, kind in _CHAT for t in _TOPICS[kind]]
    per = -(-count // 3)

    def draw(pool: list[str]) -> list[str]:
        return [pool[i] for i in rng.permutation(len(pool))[:per]]

    def problem() -> str:
        a, b, d, e = (int(x) for x in rng.integers(2, 13, size=4))
        c = int(rng.integers(20, 400))
        return _MATH[int(rng.integers(len(_MATH)))].format(a=a, b=b, c=c, d=d, e=e)

    math = list(dict.fromkeys(problem() for _ in range(per * 3)))[:per]
    banned = _evaluation_prompts()
    mixed = [p for trio in zip(draw(code), math, draw(chat)) for p in trio if p.strip() not in banned]
    if len(mixed) < count:
        raise DFlashError(f"--prompt-count {count}: the built-in set has {len(mixed)} prompts; give more with "
                          "--prompts FILE.jsonl")
    return mixed[:count]
