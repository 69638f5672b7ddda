"""A Hugging Face tokenizer (tokenizer.json, read with the `tokenizers` library) behind the
interface the tasks use: `encode`, `decode`, `pad_id`, `bos_id`, `eos_id`, `vocab_size`.

`HFTokenizer.from_dir(path)` reads a model directory as transformers does:
- the special tokens (`bos_token`, `eos_token`, `pad_token`, `unk_token`) from
  tokenizer_config.json, else special_tokens_map.json; a value is a string or an AddedToken dict
  (`{"content": ...}`), and `null` means the model has none;
- the ids that end a generation from generation_config.json's `eos_token_id` (an int or a
  list), else config.json's. `eos_id` is the tokenizer's eos token (what a chat turn ends with);
  `stop_ids` is it followed by the generation config's. When the tokenizer names no eos token,
  `eos_id` is the first of those;
- pad: the tokenizer's pad token, else generation_config / config.json `pad_token_id`, else eos;
- the chat template from chat_template.jinja, else tokenizer_config.json's `chat_template` (a
  string, or a list of named templates, of which 'default' is used).

`encode` never adds special tokens on its own (like transformers' `add_special_tokens=False`,
which is how a rendered chat template is tokenized: the template writes its own bos); ask for
them with `add_bos` / `add_eos`. `vocab_size` is config.json's `vocab_size` when the directory has
one (the embedding rows the ids index; checkpoints pad it past the tokenizer's tokens), else the
tokenizer's token count, `num_tokens`. Thread-safe: encoding and decoding hold no Python state.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers

from jaxrl_async.model.hf_config import read_json_object
from jaxrl_async.tasks import chat_template as chat_lib

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token",
                       "cls_token", "mask_token")


def _token_content(value: Any, where: str) -> str | None:
  if value is None:
    return None
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  if isinstance(value, str):
    return value
  raise ValueError(f"{where} must be a string, an AddedToken dict or null, got {value!r}")


def _id_list(value: Any, where: str) -> list[int]:
  if value is None:
    return []
  values = value if isinstance(value, list) else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
    raise ValueError(f"{where} must be an int >= 0 or a list of them, got {value!r}")
  return list(values)


def _chat_template_source(directory: pathlib.Path, config: Mapping[str, Any]) -> str | None:
  jinja_file = directory / "chat_template.jinja"
  if jinja_file.exists():
    return jinja_file.read_text(encoding="utf-8")
  source = config.get("chat_template")
  if isinstance(source, list):  # named templates
    named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
    if "default" not in named:
      raise ValueError(f"tokenizer_config.json in {directory} has named chat templates "
                       f"{sorted(map(str, named))} but none named 'default'")
    source = named["default"]
  if source is not None and not isinstance(source, str):
    raise ValueError(f"tokenizer_config.json chat_template must be a string or a list of named "
                     f"templates, got {type(source).__name__}")
  return source


class HFTokenizer:
  """A `tokenizers.Tokenizer` with its special tokens and chat template; see the module doc.

  Args:
    tokenizer: the loaded tokenizer.json.
    special_tokens: name -> token string, for names in SPECIAL_TOKEN_NAMES (None = absent).
    stop_ids: extra ids that end a generation (generation_config's eos ids).
    pad_id: used when no pad token is named; None falls back to eos.
    chat_template: Jinja source, or None.
    vocab_size: embedding rows of the model; None = the tokenizer's token count.
    additional_special_tokens: more special token strings (visible to the chat template).
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, *,
               special_tokens: Mapping[str, str | None], stop_ids: Sequence[int] = (),
               pad_id: int | None = None, chat_template: str | None = None,
               vocab_size: int | None = None, additional_special_tokens: Sequence[str] = ()):
    self._tokenizer = tokenizer
    self.additional_special_tokens = [str(t) for t in additional_special_tokens]
    self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
    unknown = set(self.special_tokens) - set(SPECIAL_TOKEN_NAMES)
    if unknown:
      raise ValueError(f"special token names must be in {SPECIAL_TOKEN_NAMES}, got {unknown}")
    ids = {name: self._special_id(name) for name in self.special_tokens}
    self.num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    self.vocab_size = int(vocab_size) if vocab_size is not None else self.num_tokens
    if self.vocab_size < self.num_tokens:
      raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's "
                       f"{self.num_tokens} tokens")
    stops = list(dict.fromkeys(_id_list(list(stop_ids), "stop_ids")))
    eos = ids.get("eos_token", stops[0] if stops else None)
    if eos is None:
      raise ValueError("no eos token: name one in tokenizer_config.json (eos_token) or give "
                       "eos_token_id in generation_config.json or config.json")
    self.eos_id = int(eos)
    self.stop_ids = tuple(dict.fromkeys([self.eos_id, *stops]))
    if max(self.stop_ids) >= self.vocab_size:
      raise ValueError(f"stop ids {self.stop_ids} must be < vocab_size={self.vocab_size}")
    self.bos_id = ids.get("bos_token")
    self.unk_id = ids.get("unk_token")
    self.pad_id = int(ids.get("pad_token", pad_id if pad_id is not None else self.eos_id))
    self.chat_template_source = chat_template
    self._template = (chat_lib.compile_chat_template(chat_template)
                      if chat_template is not None else None)

  def _special_id(self, name: str) -> int:
    token = self.special_tokens[name]
    token_id = self._tokenizer.token_to_id(token)
    if token_id is None:
      raise ValueError(f"{name}={token!r} is not a token of tokenizer.json")
    return int(token_id)

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> HFTokenizer:
    """Reads tokenizer.json, tokenizer_config.json, special_tokens_map.json,
    generation_config.json and config.json from a model directory (all but the first optional)."""
    directory = pathlib.Path(path)
    if not (directory / "tokenizer.json").exists():
      raise FileNotFoundError(f"no tokenizer.json in {directory} (a fast tokenizer file is "
                              f"needed; tokenizer.model alone is not supported)")
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    config = read_json_object(directory / "tokenizer_config.json")
    token_map = read_json_object(directory / "special_tokens_map.json")
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
      source = config if name in config else token_map
      special[name] = _token_content(source.get(name), f"{name} in {directory}")
    extra = config.get("additional_special_tokens",
                       token_map.get("additional_special_tokens")) or []
    if not isinstance(extra, list):
      raise ValueError(f"additional_special_tokens in {directory} must be a list, got {extra!r}")
    extra = [_token_content(t, f"additional_special_tokens in {directory}") for t in extra]
    generation = read_json_object(directory / "generation_config.json")
    model = read_json_object(directory / "config.json")
    ids_from = generation if "eos_token_id" in generation else model
    stop_ids = _id_list(ids_from.get("eos_token_id"), f"eos_token_id in {directory}")
    pad_ids = _id_list(generation.get("pad_token_id", model.get("pad_token_id")),
                       f"pad_token_id in {directory}")
    vocab_size = model.get("vocab_size")
    return cls(tokenizer, special_tokens=special, stop_ids=stop_ids,
               pad_id=pad_ids[0] if pad_ids else None,
               chat_template=_chat_template_source(directory, config),
               vocab_size=vocab_size, additional_special_tokens=extra)

  # ---- tokens -------------------------------------------------------------------------------
  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
    """int32 ids of `text`; special tokens written in the text (e.g. '<|im_start|>') are
    recognised. No bos/eos is added unless asked for."""
    if not isinstance(text, str):
      raise TypeError(f"encode takes a str, got {type(text).__name__}")
    ids = self._tokenizer.encode(text, add_special_tokens=False).ids
    if add_bos:
      if self.bos_id is None:
        raise ValueError("add_bos=True but this tokenizer has no bos token (bos_token is null)")
      ids = [self.bos_id, *ids]
    if add_eos:
      ids = [*ids, self.eos_id]
    return np.asarray(ids, np.int32)

  def decode(self, ids: Iterable[int] | np.ndarray, *, stop_at_eos: bool = False,
             skip_special: bool = False) -> str:
    """Text of `ids`. stop_at_eos: drop the first stop id and all after it. skip_special: drop
    special tokens (else they are written out). Ids past the tokenizer's tokens (embedding rows
    with no token) decode to nothing, as in transformers."""
    values = np.asarray(ids).reshape(-1).tolist()
    if stop_at_eos:
      stops = set(self.stop_ids)
      end = next((i for i, t in enumerate(values) if t in stops), len(values))
      values = values[:end]
    values = [t for t in values if 0 <= t < self.num_tokens]
    return self._tokenizer.decode(values, skip_special_tokens=skip_special)

  def token_to_id(self, token: str) -> int | None:
    return self._tokenizer.token_to_id(token)

  # ---- chat ---------------------------------------------------------------------------------
  @property
  def template_context(self) -> dict[str, Any]:
    """What a chat template sees of the special tokens (as transformers passes them)."""
    return {**self.special_tokens,
            "additional_special_tokens": list(self.additional_special_tokens)}

  @property
  def has_chat_template(self) -> bool:
    return self._template is not None

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """The conversation rendered by the model's chat template (see chat_template.py)."""
    if self._template is None:
      raise ValueError("this tokenizer has no chat template (no chat_template in "
                       "tokenizer_config.json and no chat_template.jinja)")
    return chat_lib.render_chat(self._template, messages,
                                add_generation_prompt=add_generation_prompt,
                                special_tokens=self.template_context, **kwargs)

  # ---- pickling (grain may send a task to worker processes) ---------------------------------
  def __getstate__(self):
    state = dict(self.__dict__)
    state["_template"] = None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    if self.chat_template_source is not None:
      self._template = chat_lib.compile_chat_template(self.chat_template_source)

  def __repr__(self) -> str:
    return (f"HFTokenizer(num_tokens={self.num_tokens}, vocab_size={self.vocab_size}, "
            f"eos_id={self.eos_id}, stop_ids={self.stop_ids}, pad_id={self.pad_id}, "
            f"bos_id={self.bos_id})")
