"""Math answer verifiers: "boxed" (ours), "dapo" (veRL's DAPO reward), "math_verify" (HF).

Each maps (completion, ground truth) to a `Grade(correct, well_formed)`. What each scores in its
own project, its native reward (correct / otherwise), and what "well formed" means here:

==============  ===========  ===================================================================
verifier        native       well formed
==============  ===========  ===================================================================
boxed           1 / 0        a \\boxed{} or "####" answer (the last number counts unless strict)
dapo            +1 / -1      an "Answer:" line in the last 300 characters (veRL ``math_dapo``)
math_verify     1 / 0        math-verify extracted an answer (veRL ``math_verify``, TRL, open-r1)
==============  ===========  ===================================================================

`MathTask` turns a grade into a reward: by default 1 / ``format_reward`` / 0 for every verifier
(so runs compare), or the verifier's native pair with ``native_reward=True``. GRPO's
group-normalized advantages are the same for 1/0 and +1/-1 (an affine map); Dr.GRPO's (no std)
differ by a factor of 2, and an added overlong penalty weighs differently against each.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable

from fp8rl_jax.tasks.answers import answers_match, extract_final_answer, has_explicit_answer
from fp8rl_jax.tasks.base import Grade

VERIFIERS = ("boxed", "dapo", "math_verify")
NATIVE_REWARDS = {"boxed": (1.0, 0.0), "dapo": (1.0, -1.0), "math_verify": (1.0, 0.0)}

Verifier = Callable[[str, str], Grade]  # (completion, ground truth) -> grade


def verify_boxed(completion: str, ground_truth: str, *, strict: bool = False) -> Grade:
    """Last \\boxed{} / "####" answer (else the last number unless `strict`), compared by
    `answers_match` (exact rationals, normalized strings)."""
    prediction = extract_final_answer(completion, fallback_last_number=not strict)
    return Grade(
        correct=answers_match(prediction, ground_truth),
        well_formed=has_explicit_answer(completion),
    )


# --- dapo: the behaviour of veRL verl/utils/reward_score/math_dapo.py (compute_score with
# strict_box_verify=False, i.e. is_correct_minerva), whose normalization comes from Minerva via
# lm-evaluation-harness hendrycks_math. The substitution and removal lists are its data, in its
# order (plain substring replacement, so order matters).

_DAPO_TAIL_CHARS = 300  # only the end of a completion is searched
_DAPO_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")  # the last match is the answer
_DAPO_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_DAPO_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
_DAPO_REWRITES = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # keep the first $...$ of a line
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # \sqrt2 -> \sqrt{2}
)


def normalize_dapo_answer(answer: str) -> str:
    """veRL ``math_dapo.normalize_final_answer``: the text after the last "=", spaces, "\\$",
    units and TeX wrappers removed, shorthand \\frac / \\sqrt braced, "$" dropped, and commas
    dropped from an all-digit answer ("1,000" -> "1000", but "-1,000" keeps its comma)."""
    s = answer.split("=")[-1]
    for old, new in _DAPO_SUBSTITUTIONS:
        s = s.replace(old, new)
    for junk in _DAPO_REMOVED:
        s = s.replace(junk, "")
    for pattern, replacement in _DAPO_REWRITES:
        s = pattern.sub(replacement, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def verify_dapo(completion: str, ground_truth: str) -> Grade:
    """veRL's DAPO check: the last "Answer: x" of the last 300 characters, normalized, equals
    the normalized ground truth as a string (no numeric or symbolic equivalence)."""
    matches = _DAPO_ANSWER_RE.findall(completion[-_DAPO_TAIL_CHARS:])
    if not matches:
        return Grade(correct=False, well_formed=False)
    prediction = normalize_dapo_answer(matches[-1])
    return Grade(correct=prediction == normalize_dapo_answer(ground_truth), well_formed=True)


# --- math_verify: HF math-verify 0.9 as veRL's verl/utils/reward_score/math_verify.py calls it:
# the gold "\boxed{gt}" parsed as LaTeX, the completion as plain expressions then LaTeX, then
# `verify` (float_rounding 6). A timeout or an unparsable gold scores incorrect, as in veRL.


def _import_math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "verifier 'math_verify' needs math-verify: pip install 'fp8rl_jax[math]'"
        ) from e
    return math_verify


@functools.cache
def _configs():
    mv = _import_math_verify()
    return (mv.LatexExtractionConfig(),), (mv.ExprExtractionConfig(), mv.LatexExtractionConfig())


@functools.lru_cache(maxsize=4096)
def _parse_gold(ground_truth: str, timeout_s: int | None):
    gold_config, _ = _configs()
    return _import_math_verify().parse(
        f"\\boxed{{{ground_truth}}}", gold_config, parsing_timeout=timeout_s
    )


def verify_math(completion: str, ground_truth: str, *, timeout_s: int | None = 5) -> Grade:
    """math-verify's symbolic equivalence (fractions, LaTeX, sets, intervals, percent, units).

    math-verify times out with ``signal.alarm`` (whole seconds per parse / comparison), which only
    works on the main thread. Off the main thread this runs without a timeout (math-verify would
    otherwise raise): a pathological expression can then hang that thread.
    """
    mv = _import_math_verify()
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    _, pred_config = _configs()
    prediction = mv.parse(completion, pred_config, parsing_timeout=timeout)
    if not prediction:
        return Grade(correct=False, well_formed=False)
    gold = _parse_gold(ground_truth, timeout)
    correct = bool(gold) and mv.verify(gold, prediction, timeout_seconds=timeout)
    return Grade(correct=bool(correct), well_formed=True)


def get_verifier(name: str, *, strict: bool = False, timeout_s: int | None = 5) -> Verifier:
    """The verifier `name` ("boxed" | "dapo" | "math_verify"); `strict` applies to "boxed",
    `timeout_s` to "math_verify" (checked importable here, so a run fails at start)."""
    if name == "boxed":
        return functools.partial(verify_boxed, strict=strict)
    if name == "dapo":
        return verify_dapo
    if name == "math_verify":
        _import_math_verify()
        return functools.partial(verify_math, timeout_s=timeout_s)
    raise ValueError(f"unknown verifier {name!r}; available: {VERIFIERS}")


__all__ = [
    "NATIVE_REWARDS",
    "VERIFIERS",
    "Verifier",
    "get_verifier",
    "normalize_dapo_answer",
    "verify_boxed",
    "verify_dapo",
    "verify_math",
]
