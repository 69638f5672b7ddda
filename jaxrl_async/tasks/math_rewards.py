"""Math answer rewards on decoded text: `reward(response_text, answer_text) -> float`.

- `exact_answer_reward`: the final answer of the response (the last `\\boxed{...}` or
  `#### ...`, whichever comes last) equals the reference's final answer (a GSM8K answer field
  ends in `#### 72`; a bare reference is its own final answer). Numbers are compared by value
  after normalisation (thousands commas, `$`, `%`, a trailing period, `72.0` = `72`, `3/4` =
  `0.75`); other answers as text with whitespace collapsed.
- `math_verify_reward`: the answer checked by math-verify (symbolic equivalence of LaTeX and
  expressions), when installed (the `math` extra). It runs without its own signal-based timeout,
  which works only in a main thread: bound it with the reward pool's timeout, or run it in
  `SubprocessReward` to kill a runaway comparison.
- `MathReward`: exact match first (cheap, and exact where it applies), then math-verify if
  installed; plus an optional weight on a format reward.
- format rewards: 1.0 when the response gives its final answer in the required form.

All are plain functions of strings, thread-safe; malformed text scores 0.0, never raises.
"""

from __future__ import annotations

import fractions
import logging
import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)", re.ASCII)  # ASCII digits only
_FRACTION = re.compile(r"([+-]?\d+)\s*/\s*(\d+)", re.ASCII)
_LATEX_FRACTION = re.compile(r"\\[dt]?frac\{([+-]?\d+)\}\{(\d+)\}", re.ASCII)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(\D|$))", re.ASCII)
MAX_NUMBER_CHARS = 1000
MATH_VERIFY_TAIL_CHARS = 4096  # math-verify reads the end of a response, where the answer is


def _closing_braces(text: str) -> dict[int, int]:
  """Position of each '{' -> position of its matching '}' (one pass; unmatched ones absent)."""
  closing, open_at = {}, []
  for position, char in enumerate(text):
    if char == "{":
      open_at.append(position)
    elif char == "}" and open_at:
      closing[open_at.pop()] = position
  return closing


def _boxed_spans(text: str) -> list[tuple[int, int, int]]:
  """(start, content start, content end) of every balanced \\boxed{...} / \\fbox{...} (nested braces kept), in
  order of start; linear in the text's length."""
  if "\\boxed{" not in text and "\\fbox{" not in text:
    return []
  closing = _closing_braces(text)
  spans = []
  for command in _BOX_COMMANDS:
    start = text.find(command + "{")
    while start != -1:
      brace = start + len(command)
      if brace in closing:
        spans.append((start, brace + 1, closing[brace]))
      start = text.find(command + "{", start + 1)
  return sorted(spans)


def extract_boxed(text: str) -> str | None:
  """Content of the last balanced \\boxed{...} (or \\fbox{...}), else None."""
  spans = _boxed_spans(text)
  return text[spans[-1][1]:spans[-1][2]].strip() if spans else None


def extract_hash_answer(text: str) -> str | None:
  """What follows the last '####' on its line (GSM8K's final-answer marker), else None."""
  position = text.rfind("####")
  if position == -1:
    return None
  answer = text[position + 4:].split("\n", 1)[0].strip()
  return answer or None


def extract_answer(text: str) -> str | None:
  """The final answer: the last boxed or '####' answer, whichever comes later in the text."""
  if not isinstance(text, str):
    return None
  spans = _boxed_spans(text)
  hash_at = text.rfind("####")
  if spans and spans[-1][0] > hash_at:
    return text[spans[-1][1]:spans[-1][2]].strip() or None
  return extract_hash_answer(text) if hash_at != -1 else None


def reference_answer(answer: str) -> str:
  """The reference's final answer: its marked answer if it has one, else the whole text."""
  marked = extract_answer(answer)
  return marked if marked is not None else answer.strip()


def _strip_wrappers(text: str) -> str:
  text = text.strip()
  for prefix in ("\\text{", "\\textbf{", "\\mathrm{"):
    if text.startswith(prefix) and text.endswith("}"):
      text = text[len(prefix):-1].strip()
  text = text.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
  text = text.replace("\\!", "").replace("\\,", "")
  return text.strip().rstrip(".").strip()


def parse_number(text: str) -> fractions.Fraction | None:
  """The value of a plain number or integer fraction ('1,234', '$5', '72.0', '-3/4'), else
  None (so 'nan', 'inf', '1e5' and expressions are not numbers here)."""
  text = _THOUSANDS.sub("", _strip_wrappers(text))
  if len(text) > MAX_NUMBER_CHARS:  # Python refuses ints of over 4300 digits; not an answer
    return None
  if _NUMBER.fullmatch(text):
    return fractions.Fraction(text)
  fraction = _FRACTION.fullmatch(text) or _LATEX_FRACTION.fullmatch(text)
  if fraction and int(fraction.group(2)) != 0:
    return fractions.Fraction(int(fraction.group(1)), int(fraction.group(2)))
  return None


def answers_match(predicted: str, reference: str) -> bool:
  """Equal as numbers when both are numbers, else as text (whitespace collapsed)."""
  a, b = parse_number(predicted), parse_number(reference)
  if a is not None and b is not None:
    return a == b
  return " ".join(_strip_wrappers(predicted).split()) == " ".join(
      _strip_wrappers(reference).split())


def exact_answer_reward(response: str, answer: str) -> float:
  """1.0 if the response's final answer matches the reference's; 0.0 otherwise (no answer,
  unbalanced braces, not a string)."""
  if not isinstance(response, str) or not isinstance(answer, str):
    return 0.0
  predicted = extract_answer(response)
  if predicted is None:
    return 0.0
  return 1.0 if answers_match(predicted, reference_answer(answer)) else 0.0


def math_verify_available() -> bool:
  try:
    import math_verify  # noqa: F401
  except ImportError:
    return False
  return True


def _drop_timeout_notice(record: logging.LogRecord) -> bool:
  """math-verify warns once that its timeout is off; here the caller bounds the time instead."""
  return not record.getMessage().startswith("Timeout is disabled")


def math_verify_reward(response: str, answer: str) -> float:
  """1.0 if math-verify finds the response's answer equivalent to the reference's final
  answer. Raises ImportError when math-verify is not installed."""
  import math_verify

  for name in ("math_verify.parser", "math_verify.grader"):
    if _drop_timeout_notice not in logging.getLogger(name).filters:
      logging.getLogger(name).addFilter(_drop_timeout_notice)

  if not isinstance(response, str) or not isinstance(answer, str):
    return 0.0
  gold = math_verify.parse(f"${reference_answer(answer)}$", parsing_timeout=None)
  predicted = math_verify.parse(response[-MATH_VERIFY_TAIL_CHARS:], parsing_timeout=None)
  if not gold or not predicted:
    return 0.0
  return 1.0 if math_verify.verify(gold, predicted, timeout_seconds=None) else 0.0


# ---- format ---------------------------------------------------------------------------------
def boxed_format_reward(response: str) -> float:
  """1.0 if the response has a non-empty, balanced \\boxed{...} answer."""
  return 1.0 if isinstance(response, str) and bool(extract_boxed(response)) else 0.0


def hash_format_reward(response: str) -> float:
  """1.0 if the response's last non-empty line is '#### <number>' (GSM8K's form)."""
  if not isinstance(response, str):
    return 0.0
  lines = [line for line in response.strip().splitlines() if line.strip()]
  if not lines or not lines[-1].lstrip().startswith("####"):
    return 0.0
  return 1.0 if parse_number(lines[-1].lstrip()[4:]) is not None else 0.0


def think_format_reward(response: str) -> float:
  """1.0 if the response is '<think>...</think>' followed by a non-empty answer, with exactly
  one of each tag."""
  if not isinstance(response, str):
    return 0.0
  match = re.fullmatch(r"\s*<think>(.*?)</think>(.*)", response, flags=re.DOTALL)
  if not match or response.count("<think>") != 1 or response.count("</think>") != 1:
    return 0.0
  return 1.0 if match.group(2).strip() else 0.0


FORMAT_REWARDS = {"boxed": boxed_format_reward, "hash": hash_format_reward,
                  "think": think_format_reward}


class MathReward:
  """correct + format_weight * format_ok, with correct from exact match, then math-verify.

  Args:
    use_math_verify: 'auto' (when installed), True (required: ImportError if missing) or False.
    format: None or a key of FORMAT_REWARDS.
    format_weight: weight of the format reward, >= 0.
  """

  def __init__(self, *, use_math_verify: bool | str = "auto", format: str | None = None,
               format_weight: float = 0.0):
    if use_math_verify not in ("auto", True, False):
      raise ValueError(f"use_math_verify must be 'auto', True or False, got {use_math_verify!r}")
    if use_math_verify is True and not math_verify_available():
      raise ImportError("use_math_verify=True needs math-verify: pip install 'jaxrl_async[math]'")
    if format is not None and format not in FORMAT_REWARDS:
      raise ValueError(f"format must be None or one of {sorted(FORMAT_REWARDS)}, got {format!r}")
    if not format_weight >= 0:
      raise ValueError(f"format_weight must be >= 0, got {format_weight!r}")
    self.use_math_verify = bool(use_math_verify and math_verify_available())
    self.format, self.format_weight = format, float(format_weight)

  def correct(self, response: str, answer: str) -> float:
    if exact_answer_reward(response, answer) == 1.0:
      return 1.0
    return math_verify_reward(response, answer) if self.use_math_verify else 0.0

  def __call__(self, response: str, answer: str) -> float:
    value = self.correct(response, answer)
    if self.format is not None and self.format_weight:
      value += self.format_weight * FORMAT_REWARDS[self.format](response)
    return value

  def __repr__(self) -> str:
    return (f"MathReward(use_math_verify={self.use_math_verify}, format={self.format!r}, "
            f"format_weight={self.format_weight})")
