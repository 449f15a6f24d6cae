"""Word problems about a count that changes, asked in words and answered in free text: the
grade-school format of GSM8K (Cobbe et al., 2021, "Training Verifiers to Solve Math Word
Problems") at the size a small instruction-tuned chat model can sometimes solve::

    Lily has 15 books and buys 8 more. How many books does Lily have now?

Difficulty D: D changes to the starting count, alternately buying more (+) and giving some away
(−), so D = 1 is one addition. The prompt is the question alone, a user message that a study
renders through the model's chat template; the worked solution writes one operation a line, then
the answer line. A completion is free text, so `extract_answer` reads the number after its last
answer marker ("answer: 23", "The answer is 23", "#### 23") or else its last number, and the
checker compares that number with the count exactly.
"""

from __future__ import annotations

import random
import re
from decimal import Decimal, InvalidOperation

from decoderlm.tasks.base import Problem, Task

NAMES = ("Tom", "Anna", "Ben", "Lily", "Sam", "Mia", "Jack", "Emma")
ITEMS = ("apples", "pencils", "marbles", "cookies", "stickers", "books", "cards", "shells")
START = (5, 20)  # the starting count's range
CHANGE = (2, 15)  # how many are bought or given away (never more than are held)
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 23, -4, 1,250, 2.5
_MARKED = re.compile(rf"(?:answer[^\d\n-]{{0,8}}|####\s*)({_NUMBER})", re.IGNORECASE)
_ANY = re.compile(_NUMBER)


def make(rng: random.Random, difficulty: int) -> Problem:
    """A starting count and `difficulty` changes to it, alternately buying and giving away."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count = rng.randint(*START)
    changes, lines = [], []
    for i in range(difficulty):
        if i % 2 == 0:
            bought = rng.randint(*CHANGE)
            changes.append(f"buys {bought} more")
            lines.append(f"{count} + {bought} = {count + bought}")
            count += bought
        else:
            given = rng.randint(1, min(CHANGE[1], count - 1))
            changes.append(f"gives {given} away")
            lines.append(f"{count} - {given} = {count - given}")
            count -= given
    start = lines[0].split(" ")[0]
    if difficulty == 1:
        story = f"{name} has {start} {item} and {changes[0]}."
    else:
        story = f"{name} has {start} {item}. {name} {', then '.join(changes)}."
    prompt = f"{story} How many {item} does {name} have now?"
    solution = "".join(line + "\n" for line in lines) + f"answer: {count}\n"
    return Problem(prompt, solution, str(count), (name, item, int(start), tuple(changes)))


def extract_answer(completion: str) -> str | None:
    """The number the completion answers with, normalised ("1,250" → "1250", "23.0" → "23"): the
    one after its last answer marker, else its last number; None if it has none."""
    marked = _MARKED.findall(completion)
    found = marked[-1] if marked else next(reversed(_ANY.findall(completion)), None)
    return None if found is None else normalise(found)


def normalise(number: str) -> str | None:
    """A number's canonical text: no thousands separators, an integral value without decimals."""
    try:
        value = Decimal(number.replace(",", ""))
    except InvalidOperation:
        return None
    return str(int(value)) if value == value.to_integral_value() else str(value.normalize())


def check(problem: Problem, completion: str) -> bool:
    """Whether the completion's answer is the final count."""
    return extract_answer(completion) == problem.answer


WORD_PROBLEMS = Task("word-problems", 1, make, check, extract_answer)
