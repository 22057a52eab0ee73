"""Final-answer extraction and equivalence for math problems (GSM8K / DAPO-Math style)."""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_LAST_NUMBER_RE = re.compile(rf"(?:{_NUMBER})(?:/\d+)?")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC_RE = re.compile(r"^(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}$|^(-?)\\frac(\d)(\d)$")
_PLAIN_FRAC_RE = re.compile(r"^(-?\d+)/(\d+)$")
_VARIABLE_PREFIX_RE = re.compile(r"^[a-z]\s*=\s*")


def _last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...}, with nested braces balanced; None if absent/unclosed."""
    matches = list(_BOXED_RE.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    return None


def extract_final_answer(text: str, *, fallback_last_number: bool = True) -> str | None:
    """The final answer in a solution: last \\boxed{...}, else text after the last "####",
    else (optionally) the last number. None if nothing is found."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        answer = text.rsplit("####", 1)[1].strip().splitlines()
        return answer[0].strip() if answer and answer[0].strip() else None
    if fallback_last_number:
        numbers = _LAST_NUMBER_RE.findall(text)
        if numbers:
            return numbers[-1]
    return None


def has_explicit_answer(text: str) -> bool:
    """True if the text marks its final answer (\\boxed{...} or "#### x"): the format reward."""
    return extract_final_answer(text, fallback_last_number=False) is not None


def normalize_answer(answer: str) -> str:
    """Canonical string form: no $, spacing commands, \\text{}, \\left/\\right, degree signs,
    trailing period, or leading "x ="; lower case; no spaces."""
    s = answer.strip()
    s = re.sub(r"\\text\{([^{}]*)\}|\\mathrm\{([^{}]*)\}", lambda m: m.group(1) or m.group(2), s)
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", "")):
        s = s.replace(old, new)
    for junk in ("\\$", "$", "\\!", "\\,", "\\;", "\\ ", "^\\circ", "^{\\circ}", "°"):
        s = s.replace(junk, "")
    s = s.strip().rstrip(".").strip().lower()
    s = _VARIABLE_PREFIX_RE.sub("", s)
    return re.sub(r"\s+", "", s)


def parse_number(answer: str) -> tuple[Fraction, bool] | None:
    """Exact value of a numeric answer and whether it had a percent sign; None if not numeric.

    Accepts ints, decimals, "1,000", "3/4", "\\frac{3}{4}", "-\\frac34", "50%" / "50\\%".
    """
    s = normalize_answer(answer)
    percent = s.endswith("%")
    if percent:
        s = s.removesuffix("\\%").removesuffix("%")
    if _NUMBER_RE.fullmatch(s):
        return Fraction(s.replace(",", "")), percent
    if m := _PLAIN_FRAC_RE.fullmatch(s):
        numerator, denominator = int(m.group(1)), int(m.group(2))
        return (Fraction(numerator, denominator), percent) if denominator else None
    if m := _FRAC_RE.fullmatch(s):
        sign, numerator, denominator = (m.group(1), m.group(2), m.group(3))
        if numerator is None:
            sign, numerator, denominator = m.group(4), m.group(5), m.group(6)
        numerator_value, denominator_value = parse_number(numerator), parse_number(denominator)
        if numerator_value is None or denominator_value is None or denominator_value[0] == 0:
            return None
        value = numerator_value[0] / denominator_value[0]
        return (-value if sign else value), percent
    return None


def answers_match(
    prediction: str | None, reference: str, *, percent_as_fraction: bool = True
) -> bool:
    """Exact rational equality when both parse as numbers, else equal normalized strings.

    "50%" equals "50"; with `percent_as_fraction` it also equals "0.5".
    """
    if prediction is None:
        return False
    pred, ref = parse_number(prediction), parse_number(reference)
    if pred is not None and ref is not None:
        (pred_value, pred_pct), (ref_value, ref_pct) = pred, ref
        if pred_value == ref_value:
            return True
        if percent_as_fraction and pred_pct != ref_pct:
            return (pred_value / 100 if pred_pct else pred_value) == (
                ref_value / 100 if ref_pct else ref_value
            )
        return False
    return normalize_answer(prediction) == normalize_answer(reference)
