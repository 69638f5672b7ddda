"""Chat templates (the Jinja source in a model's tokenizer_config.json) rendered as transformers
renders them.

transformers compiles a chat template in a sandboxed, immutable Jinja environment with
`trim_blocks=True` and `lstrip_blocks=True` and the `loopcontrols` extension (`{% break %}`), a
`tojson` filter that keeps non-ASCII characters, and two globals: `raise_exception(message)`
(a template's way to reject a conversation) and `strftime_now(format)`. It renders with
`messages`, `add_generation_prompt`, `tools`, `documents`, the tokenizer's special tokens as
strings (`bos_token`, `eos_token`, ...) and any extra keyword arguments. This module does the
same with jinja2 alone, so a prompt rendered here is the prompt the model was trained on.
The `{% generation %}` tag (transformers' assistant-mask extension) is not supported.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox


class ChatTemplateError(ValueError):
  """The template rejected the conversation (`raise_exception`) or does not compile."""


def _raise_exception(message: str):
  raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
  return datetime.datetime.now().strftime(date_format)


def compile_chat_template(source: str) -> jinja2.Template:
  """Compiles a chat template's Jinja source in transformers' environment."""
  if not isinstance(source, str) or not source:
    raise ChatTemplateError(f"chat template must be a non-empty string, got {source!r}")
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as error:
    raise ChatTemplateError(f"chat template does not compile: {error} (line {error.lineno})"
                            ) from error


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """Messages as a list of dicts, each with a string 'role' and a 'content'."""
  if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
    raise ChatTemplateError(f"messages must be a list of {{'role', 'content'}} dicts, got "
                            f"{type(messages).__name__}")
  checked = []
  for position, message in enumerate(messages):
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
      raise ChatTemplateError(f"message {position} must be a dict with a string 'role', got "
                              f"{message!r}")
    if "content" not in message:
      raise ChatTemplateError(f"message {position} ({message['role']!r}) has no 'content'")
    checked.append(dict(message))
  return checked


def render_chat(template: jinja2.Template, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True,
                special_tokens: Mapping[str, str] | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None,
                documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
  """The conversation as the template writes it.

  add_generation_prompt: end with the opening of an assistant turn (what a policy continues).
  special_tokens: e.g. {'bos_token': '<s>', 'eos_token': '</s>'}, visible to the template;
    keyword arguments override them, as in transformers.
  """
  context = {**(special_tokens or {}), **kwargs}
  try:
    return template.render(messages=check_messages(messages), tools=tools, documents=documents,
                           add_generation_prompt=bool(add_generation_prompt), **context)
  except ChatTemplateError:
    raise
  except jinja2.TemplateError as error:
    raise ChatTemplateError(f"chat template failed to render: {error}") from error
