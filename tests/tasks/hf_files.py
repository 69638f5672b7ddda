"""A tiny Hugging Face model directory's tokenizer files, built with the `tokenizers` library."""

from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]

# The ChatML layout of Qwen2.5's template (its tool branches left out): a default system turn
# when the conversation has none, whitespace control with '-'.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Unknown role: ' + message.role) }}\n"
    "    {%- endif %}\n"
    "    {%- if not (message.role == 'system' and loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")

# Llama-3-Instruct's template (one line; bos_token comes from the context).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

_CORPUS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many.",
           "How many clips did Natalia sell altogether in April and May? The answer is 72.",
           "Weng earns $12 an hour for babysitting. #### 10", "\\boxed{42} user assistant system"]


def build_tokenizer(specials: list[str], vocab_size: int = 400) -> Tokenizer:
  """A byte-level BPE tokenizer (any text encodes and decodes back) with `specials` first."""
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator(_CORPUS * 4, trainer)
  return tokenizer


def _write(directory: pathlib.Path, name: str, value) -> None:
  with open(directory / name, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=1)


def write_qwen_like(directory: pathlib.Path, *, vocab_size: int | None = 512) -> pathlib.Path:
  """tokenizer.json, tokenizer_config.json, generation_config.json, config.json as Qwen2.5
  Instruct ships them: no bos, eos <|im_end|>, pad <|endoftext|>, two eos ids to stop on."""
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer = build_tokenizer(CHATML_SPECIALS)
  tokenizer.save(str(directory / "tokenizer.json"))
  _write(directory, "tokenizer_config.json", {
      "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
      "unk_token": None, "chat_template": QWEN_TEMPLATE, "model_max_length": 32768})
  _write(directory, "generation_config.json", {"eos_token_id": [2, 0], "pad_token_id": 0})
  config = {"architectures": ["Qwen2ForCausalLM"], "eos_token_id": 0}
  if vocab_size is not None:
    config["vocab_size"] = vocab_size
  _write(directory, "config.json", config)
  return directory


def write_llama3_like(directory: pathlib.Path) -> pathlib.Path:
  """As Llama-3 Instruct: bos <|begin_of_text|> (an AddedToken dict), eos <|eot_id|>, no pad
  token; generation_config stops on <|end_of_text|> and <|eot_id|>."""
  directory.mkdir(parents=True, exist_ok=True)
  tokenizer = build_tokenizer(LLAMA3_SPECIALS)
  tokenizer.save(str(directory / "tokenizer.json"))
  _write(directory, "tokenizer_config.json", {
      "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False},
      "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE})
  _write(directory, "generation_config.json", {"bos_token_id": 0, "eos_token_id": [1, 4]})
  _write(directory, "config.json", {"architectures": ["LlamaForCausalLM"], "vocab_size": 400,
                                    "bos_token_id": 0, "eos_token_id": 1})
  return directory
