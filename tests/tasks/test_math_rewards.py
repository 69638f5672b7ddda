import pytest

from jaxrl_async.tasks import math_rewards as mr

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"


@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{72}.", "72"),
    ("\\boxed{1} then \\boxed{2}", "2"),                         # the last one
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                   # nested braces kept
    ("\\boxed{\\boxed{5}}", "5"),                                # the innermost, last to start
    ("\\fbox{7}", "7"),
    ("#### 72", "72"),
    ("Work...\n#### 1,234\nThanks", "1,234"),                    # to the end of its line
    ("\\boxed{3} ... #### 4", "4"),                              # whichever comes last
    ("#### 4 ... \\boxed{3}", "3"),
    ("\\boxed{72", None),                                        # unbalanced
    ("\\boxed{}", None),                                         # empty
    ("####   \n", None),
    ("The answer is 72.", None),                                 # no marked answer
    ("", None),
    (None, None),
])
def test_extract_answer(text, expected):
  assert mr.extract_answer(text) == expected


@pytest.mark.parametrize("text, value", [
    ("72", 72), ("72.0", 72), ("72.", 72), ("$1,234", 1234), ("1,234,567", 1234567),
    ("\\$5.50", 5.5), ("50%", 50), ("-3/4", -0.75), ("\\frac{3}{4}", 0.75), (" 0.50 ", 0.5),
    ("\\text{12}", 12), ("+7", 7),
])
def test_parse_number(text, value):
  assert mr.parse_number(text) == value


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "1e5", "x", "1/0", "", "1,23",
                                  "٧٢", "7 2", "1" * 5000])
def test_not_numbers(text):
  assert mr.parse_number(text) is None


@pytest.mark.parametrize("response, expected", [
    ("48 + 24 = 72\n#### 72", 1.0),
    ("The answer is \\boxed{72}.", 1.0),
    ("\\boxed{72.00}", 1.0),
    ("#### $72", 1.0),
    ("#### 72.", 1.0),
    ("#### 73", 0.0),
    ("\\boxed{72} wait, no: \\boxed{71}", 0.0),                  # the last answer counts
    ("I think it is 72", 0.0),                                   # no final-answer marker
    ("", 0.0),
    ("\\boxed{72", 0.0),                                         # unbalanced: no answer
    ("#### nan", 0.0),
    ("#### 72" + "\U0001F600" * 3, 0.0),                         # not a number any more
    ("\U0001F600 unicode first\n#### 72", 1.0),
    ("\\boxed{" * 50_000 + "72" + "}" * 50_000, 1.0),           # deep nesting, linear time
    ("x" * 1_000_000 + "\n#### 72", 1.0),                        # huge output
    ("9" * 1_000_000, 0.0),
])
def test_exact_answer_reward(response, expected):
  assert mr.exact_answer_reward(response, GSM8K_ANSWER) == expected


def test_reference_forms():
  assert mr.exact_answer_reward("#### 3/4", "0.75") == 1.0        # a bare reference
  assert mr.exact_answer_reward("\\boxed{x + 1}", "\\boxed{x+1}") == 0.0  # text, not algebra
  assert mr.exact_answer_reward("\\boxed{x  +  1}", "#### x + 1") == 1.0
  assert mr.exact_answer_reward("\\boxed{Paris}", "paris") == 0.0
  assert mr.exact_answer_reward(None, GSM8K_ANSWER) == 0.0
  assert mr.exact_answer_reward("#### 72", None) == 0.0


needs_math_verify = pytest.mark.skipif(not mr.math_verify_available(),
                                       reason="math-verify is not installed (the math extra)")


@needs_math_verify
@pytest.mark.parametrize("response, answer, expected", [
    ("\\boxed{\\frac{144}{2}}", GSM8K_ANSWER, 1.0),
    ("so it is $72$", GSM8K_ANSWER, 1.0),
    ("\\boxed{x+1}", "\\boxed{1 + x}", 1.0),                       # symbolic equivalence
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{71}", GSM8K_ANSWER, 0.0),
    ("no answer here", GSM8K_ANSWER, 0.0),
    ("", GSM8K_ANSWER, 0.0),
    ("\\boxed{nan}", GSM8K_ANSWER, 0.0),
    ("\\boxed{\\infty}", GSM8K_ANSWER, 0.0),
])
def test_math_verify_reward(response, answer, expected):
  assert mr.math_verify_reward(response, answer) == expected


@needs_math_verify
def test_math_reward_uses_math_verify_when_installed():
  assert mr.MathReward()("\\boxed{x+1}", "1 + x") == 1.0
  assert mr.MathReward(use_math_verify=False)("\\boxed{x+1}", "1 + x") == 0.0
  assert mr.MathReward(use_math_verify=True).use_math_verify


def test_math_reward_with_format_weight():
  reward = mr.MathReward(use_math_verify=False, format="boxed", format_weight=0.1)
  assert reward("\\boxed{72}", GSM8K_ANSWER) == pytest.approx(1.1)
  assert reward("\\boxed{71}", GSM8K_ANSWER) == pytest.approx(0.1)
  assert reward("#### 72", GSM8K_ANSWER) == 1.0
  assert reward("nothing", GSM8K_ANSWER) == 0.0


@pytest.mark.parametrize("kwargs, knob", [({"format": "xml"}, "format"),
                                          ({"format_weight": -1.0}, "format_weight"),
                                          ({"use_math_verify": "yes"}, "use_math_verify")])
def test_math_reward_bad_knobs(kwargs, knob):
  with pytest.raises(ValueError, match=knob):
    mr.MathReward(**kwargs)


@pytest.mark.parametrize("response, boxed, hashed, think", [
    ("\\boxed{4}", 1.0, 0.0, 0.0),
    ("work\n#### 4\n", 0.0, 1.0, 0.0),
    ("work\n#### four", 0.0, 0.0, 0.0),
    ("#### 4\nand then more text", 0.0, 0.0, 0.0),
    ("<think>2+2</think> \\boxed{4}", 1.0, 0.0, 1.0),
    ("<think>2+2</think>", 0.0, 0.0, 0.0),                      # nothing after thinking
    ("<think><think>x</think>4", 0.0, 0.0, 0.0),
    ("answer first <think>x</think> 4", 0.0, 0.0, 0.0),
    ("\\boxed{", 0.0, 0.0, 0.0),
    ("", 0.0, 0.0, 0.0),
    (None, 0.0, 0.0, 0.0),
])
def test_format_rewards(response, boxed, hashed, think):
  assert mr.boxed_format_reward(response) == boxed
  assert mr.hash_format_reward(response) == hashed
  assert mr.think_format_reward(response) == think
