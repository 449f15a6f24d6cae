"""Countdown (as in TinyZero and Gandhi et al., 2024, "Stream of Search"): reach a target from given
numbers with + − × ÷, each number used at most once.

Difficulty D: D numbers from 1 to 12. The target is made by combining all of them in a random
order, so every problem has a solution; the worked one writes a combination a line, then the
expression. Any valid expression is accepted: the checker parses it (numbers, + - * / and
parentheses only) and evaluates it exactly with fractions::

    Countdown: 3 7 2 -> 23
    7*3=21
    21+2=23
    answer: (7*3)+2
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from fractions import Fraction

from decoderlm.tasks.base import Problem, Task, answer_line

MAX_NUMBER = 12
MAX_TARGET = 999
MAX_EXPRESSION = 200  # characters: a longer answer is refused before it is parsed
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def make(rng: random.Random, difficulty: int) -> Problem:
    """`difficulty` numbers and a target that combining all of them reaches (integers on the way)."""
    while True:
        numbers = [rng.randint(1, MAX_NUMBER) for _ in range(difficulty)]
        pool = [(n, str(n)) for n in numbers]
        lines = []
        while len(pool) > 1:
            (a, x), (b, y) = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
            if a < b:
                (a, x), (b, y) = (b, y), (a, x)
            ops = ["+", "*"] + (["-"] if a > b else []) + (["/"] if a % b == 0 and b > 1 else [])
            op = rng.choice(ops)
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
            lines.append(f"{a}{op}{b}={value}")
            pool.append((value, f"({x}{op}{y})"))
        target, expression = pool[0]
        if 1 <= target <= MAX_TARGET:
            break
    expression = expression[1:-1] if len(numbers) > 1 else expression
    solution = "".join(line + "\n" for line in lines) + f"answer: {expression}\n"
    prompt = f"Countdown: {' '.join(map(str, numbers))} -> {target}\n"
    return Problem(prompt, solution, expression, (tuple(numbers), target))


def extract_answer(completion: str) -> str | None:
    """The expression of the completion's answer line, spaces removed (None: none)."""
    said = answer_line(completion)
    return None if said is None else "".join(said.split())


def check(problem: Problem, completion: str) -> bool:
    """Whether the completion's expression uses only the given numbers, each at most once, and
    equals the target exactly."""
    numbers, target = problem.data
    expression = extract_answer(completion)
    if expression is None or len(expression) > MAX_EXPRESSION:
        return False
    try:
        tree = ast.parse(expression, mode="eval").body
        used: list[int] = []
        value = _evaluate(tree, used)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return False
    return not Counter(used) - Counter(numbers) and value == target


def _evaluate(node: ast.expr, used: list[int]) -> Fraction:
    """The exact value of a + - * / expression of non-negative integers; ValueError otherwise."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        return left / right
    raise ValueError("not a + - * / expression of integers")


COUNTDOWN = Task("countdown", 3, make, check, extract_answer)
