"""Whether a predicted mathematical answer equals a reference one.

Order of checks in `answers_match`:
1. a plain comparison (always available, fast): both sides normalised (surrounding `$`, `\\boxed{}`,
   thousands commas, a trailing period and outer spaces removed) and compared as exact numbers
   when both are plain numbers ("42" == "42.0" == "042" == "$42$", "1,000" == "1000",
   "3/4" == "0.75"), otherwise as lower-cased strings; "4 2" is not 42;
2. if that fails, `math_verify.verify(parse(gold), parse(pred))`, which also accepts symbolic forms
   ("\\frac{3}{4}", "84/2") and tolerates units or text ("42 dollars"). math-verify times out with
   SIGALRM, which only works in the main thread: elsewhere, or when math-verify is not installed or
   raises, only the plain comparison is used.
Before either, a sign followed by spaces is closed up ("- 42" -> "-42"; math-verify would read 42).
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:/[0-9]+)?")
_THOUSANDS_RE = re.compile(r"(?<=[0-9]),(?=[0-9]{3}(?:[^0-9]|$))")
_BOXED_RE = re.compile(r"^\\boxed\{(.*)\}$")
_MAX_NUMBER_LENGTH = 100
_MATH_VERIFY_TIMEOUT_S = 2


def close_sign(text: str) -> str:
    """Strips `text` and removes spaces after a leading sign and a leading '+': "+ 7" -> "7"."""
    text = re.sub(r"^([+-])\s+", r"\1", text.strip())
    return text[1:] if text.startswith("+") else text


def normalise(text: str) -> str:
    """The plain normal form of an answer string (see the module docstring)."""
    text = close_sign(text)
    for _ in range(3):  # peel nested wrappers such as "$\\boxed{42}$"
        previous = text
        if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
            text = text.strip("$").strip()
        match = _BOXED_RE.match(text)
        if match:
            text = match.group(1).strip()
        if text == previous:
            break
    text = _THOUSANDS_RE.sub("", text)
    text = text.rstrip(".") if re.fullmatch(r".*[0-9]\.", text) else text
    return close_sign(" ".join(text.split())).lower()


def as_number(text: str) -> Fraction | None:
    """The exact value of a plain number ("-3", "4.50", "3/4") after `normalise`, else None."""
    text = normalise(text)
    if len(text) > _MAX_NUMBER_LENGTH or not _NUMBER_RE.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def plain_match(pred: str, gold: str) -> bool:
    """The plain comparison: exact numbers if both parse as numbers, else normalised strings."""
    p, g = as_number(pred), as_number(gold)
    if p is not None and g is not None:
        return p == g
    pn, gn = normalise(pred), normalise(gold)
    return bool(pn) and pn == gn


def math_verify_match(pred: str, gold: str) -> bool | None:
    """math-verify's verdict, or None where it cannot run (not installed, not the main thread, raised)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:  # optional at run time: the plain comparison still works without math-verify
        from math_verify import parse, verify
    except ImportError:
        return None
    try:
        gold_parsed = parse(gold, parsing_timeout=_MATH_VERIFY_TIMEOUT_S)
        pred_parsed = parse(close_sign(pred), parsing_timeout=_MATH_VERIFY_TIMEOUT_S)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=_MATH_VERIFY_TIMEOUT_S))
    except Exception:  # math-verify documents that it may raise; fall back to the plain check
        return None


def answers_match(pred: str, gold: str, use_math_verify: bool = True) -> bool:
    """Whether answer `pred` equals reference `gold` (plain check, then math-verify if enabled)."""
    if plain_match(pred, gold):
        return True
    if not use_math_verify:
        return False
    return bool(math_verify_match(pred, gold))
