"""Build the tiny Hugging Face fixtures under tests/fixtures/hf/ (run by a developer, not by CI).

Needs torch and transformers, which the package and its tests never import; keep them in a
separate virtual environment:

    python3 -m venv /tmp/fixture-venv
    /tmp/fixture-venv/bin/pip install torch==2.13.0 transformers==4.57.6 tokenizers jinja2
    /tmp/fixture-venv/bin/python tools/make_hf_fixtures.py        # about a minute on a CPU

For each family (llama: Llama 3.x with 'llama3' RoPE scaling and an untied head, saved in several
safetensors shards with an index; qwen2: q/k/v biases and tied embeddings; qwen3: q/k norms and a
head_dim that is not hidden_size / num_heads) it writes a random model in float32 with its
tokenizer files (a byte-level BPE trained here on a small text, special tokens, a chat template
in tokenizer_config.json), and records with transformers (eager attention, float32):
- reference_logits.npz: the logits of each prompt in reference.json (`logits_<i>`, [T, V]);
- reference.json: the prompts' token ids, 20-token greedy continuations (full forward each step,
  no end token) with the smallest top-1 / top-2 logit margin seen along them, and
  `apply_chat_template` renderings of a few conversations (text and token ids).
Weights are drawn so that greedy steps are not near ties and continuations do not just repeat
one token (a seed is retried otherwise).

`--tf5-fixtures` (transformers 5 only, in its own virtual environment) writes
tests/fixtures/hf/{llama,qwen2,qwen3}-tf5 instead: a random tiny model of each family saved by
transformers 5, so its config.json holds RoPE in the 5.x layout (`rope_parameters`, no top-level
rope_theta: llama3 scaling with theta 5e5 for llama, theta 1e6 for the Qwens), without a
tokenizer or special token ids. For two prompts of random token ids (in reference.json, with their
20-token greedy continuations as above, seeds retried the same way) reference_logits.npz holds the
logits transformers computes (`default_<i>`), and for qwen2-tf5 also with each RoPE variant of
ROPE_VARIANTS (linear, llama3, YaRN) on the same weights (`<variant>_<i>`). With the torch and
transformers versions that reference.json records, a rebuild writes the same weights, prompts and
greedy tokens (on one machine the same bytes; logits may differ in their last bits between CPUs):

    python3 -m venv tf5-venv
    tf5-venv/bin/pip install torch==2.13.0 'transformers>=5' safetensors
    tf5-venv/bin/python tools/make_hf_fixtures.py --tf5-fixtures   # a few seconds

`--resave-configs` (transformers 5 too) writes tests/fixtures/hf/configs/fixture-<family>.tf5.json:
the config.json of each fixture above as transformers 5 loads and saves it. `--out DIR` writes
into DIR instead of tests/fixtures/hf (e.g. to compare a rebuild with the stored files).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "hf"
GREEDY_STEPS = 20
MIN_MARGIN = 0.05  # smallest top-1 minus top-2 logit allowed along a greedy continuation
MIN_DISTINCT = 4  # distinct tokens each greedy continuation must hold (no degenerate repeats)

CORPUS = """\
Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.
How many clips did Natalia sell altogether in April and May? Natalia sold 48/2 = 24 clips in May.
Natalia sold 48+24 = 72 clips altogether in April and May. #### 72
Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.
How much did she earn? Weng earns 12/60 = $0.2 per minute. She earned 0.2 x 50 = $10. #### 10
Betty is saving money for a new wallet which costs $100. Betty has only half of the money.
Her parents decided to give her $15 for that purpose, and her grandparents twice as much.
You are a helpful assistant. Solve the problem step by step and put the final answer last.
The answer is \\boxed{42}. Let's think step by step. First, we add the numbers together.
"""

# Chat templates in the two formats these families use (ChatML; Llama 3 headers).
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHATML_THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "Natalia sold 48 clips in April. How many in May?"}],
    [{"role": "system", "content": "Solve the problem step by step."},
     {"role": "user", "content": "Weng earns $12 an hour. How much for 50 minutes?"}],
    [{"role": "user", "content": "What is 2 + 3?"},
     {"role": "assistant", "content": "The answer is 5. #### 5"},
     {"role": "user", "content": "  And 4 + 4?  "}],
]
PROMPTS = ["Natalia sold clips", "How many clips did Natalia sell altogether in April and May?",
           "Betty is saving money for a new wallet which costs $100. Her parents"]

FAMILIES = {
    "llama": dict(
        config_class="LlamaConfig", model_class="LlamaForCausalLM",
        special={"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": None},
        extra_special=["<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"],
        template=LLAMA3_TEMPLATE, template_kwargs=[{}, {}, {}],
        config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    rope_theta=500_000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
                    tie_word_embeddings=False,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 32}),
        max_shard_size="60KB"),
    "qwen2": dict(
        config_class="Qwen2Config", model_class="Qwen2ForCausalLM",
        special={"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>"},
        extra_special=["<|im_start|>"],
        template=CHATML_TEMPLATE, template_kwargs=[{}, {}, {}],
        config=dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, rope_theta=1_000_000.0,
                    rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=True,
                    use_sliding_window=False),
        max_shard_size=None),
    "qwen3": dict(
        config_class="Qwen3Config", model_class="Qwen3ForCausalLM",
        special={"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>"},
        extra_special=["<|im_start|>"],
        template=CHATML_THINKING_TEMPLATE,
        template_kwargs=[{}, {"enable_thinking": False}, {"enable_thinking": True}],
        config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=256,
                    tie_word_embeddings=True, use_sliding_window=False),
        max_shard_size=None),
}
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
# transformers 5 renamed config's torch_dtype to dtype and always writes safetensors.
DTYPE_KWARG = "dtype" if TRANSFORMERS_5 else "torch_dtype"
SAFE_SERIALIZATION = {} if TRANSFORMERS_5 else {"safe_serialization": True}
TRAINED_VOCAB = 384  # byte alphabet (256) + merges, before the special tokens
MODEL_VOCAB = 400  # embedding rows; more than the tokenizer's ids, as Qwen's checkpoints have


def train_tokenizer(specials: list[str]) -> Tokenizer:
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
  trainer = trainers.BpeTrainer(vocab_size=TRAINED_VOCAB, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
  tokenizer.add_special_tokens(specials)
  return tokenizer


def fast_tokenizer(spec: dict, directory: pathlib.Path):
  special = spec["special"]
  names = [t for t in (special["bos"], special["eos"], special["pad"]) if t]
  specials = list(dict.fromkeys(names + spec["extra_special"]))
  raw = train_tokenizer(specials)
  tokenizer = transformers.PreTrainedTokenizerFast(
      tokenizer_object=raw, bos_token=special["bos"], eos_token=special["eos"],
      pad_token=special["pad"], additional_special_tokens=spec["extra_special"],
      model_max_length=256, clean_up_tokenization_spaces=False)
  tokenizer.chat_template = spec["template"]
  tokenizer.save_pretrained(directory)
  # Published checkpoints keep the template inside tokenizer_config.json; do the same.
  config_path = directory / "tokenizer_config.json"
  config = json.loads(config_path.read_text())
  config["chat_template"] = spec["template"]
  config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
  (directory / "chat_template.jinja").unlink(missing_ok=True)
  return transformers.AutoTokenizer.from_pretrained(directory)


def randomize(model, seed: int, gain: float = 1.0) -> None:
  """Random weights; `gain` scales the linear layers so that the blocks, not the tied embedding
  of the last token, dominate the residual stream (else greedy decoding repeats a token)."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn(param.shape, generator=generator)
      if name.endswith("norm.weight"):
        param.copy_(1.0 + 0.2 * noise)
      elif name.endswith("bias") or "embed_tokens" in name or "lm_head" in name:
        param.copy_(0.5 * noise)
      else:
        param.copy_(gain * noise * param.shape[-1] ** -0.5)


def greedy(model, prompt: list[int]) -> tuple[list[int], float]:
  tokens, margin = list(prompt), float("inf")
  with torch.no_grad():
    for _ in range(GREEDY_STEPS):
      logits = model(torch.tensor([tokens])).logits[0, -1]
      top = torch.topk(logits, 2).values
      margin = min(margin, float(top[0] - top[1]))
      tokens.append(int(torch.argmax(logits)))
  return tokens[len(prompt):], margin


def draw_model(name: str, make_model, prompts: list[list[int]], seed: int,
               min_distinct: int = MIN_DISTINCT):
  """The first random model (seeds seed, seed + 1, ...) whose greedy continuations of `prompts`
  have top-1 / top-2 margins >= MIN_MARGIN and >= `min_distinct` distinct tokens each.
  Returns (model, attempt, continuations, min margin, min distinct tokens)."""
  for attempt in range(50):
    torch.manual_seed(seed + attempt)
    model = make_model().eval()
    randomize(model, seed + attempt, gain=2.0)
    continuations = [greedy(model, p) for p in prompts]
    margin = min(m for _, m in continuations)
    distinct = min(len(set(c)) for c, _ in continuations)
    if margin >= MIN_MARGIN and distinct >= min_distinct:
      return model, attempt, continuations, margin, distinct
  raise RuntimeError(f"{name}: no seed gave greedy margins >= {MIN_MARGIN} with "
                     f">= {min_distinct} distinct tokens")


def build_family(name: str, spec: dict, seed: int, out: pathlib.Path = OUT) -> dict:
  directory = out / name
  shutil.rmtree(directory, ignore_errors=True)
  directory.mkdir(parents=True)
  tokenizer = fast_tokenizer(spec, directory)
  special = spec["special"]
  ids = {k: (tokenizer.convert_tokens_to_ids(v) if v else None) for k, v in special.items()}
  config = getattr(transformers, spec["config_class"])(
      vocab_size=MODEL_VOCAB, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
      pad_token_id=ids["pad"], attn_implementation="eager", **{DTYPE_KWARG: "float32"},
      **spec["config"])
  prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROMPTS]
  if ids["bos"] is not None:
    prompts = [[ids["bos"]] + p for p in prompts]
  model, attempt, continuations, margin, distinct = draw_model(
      name, lambda: getattr(transformers, spec["model_class"])(config), prompts, seed)
  with torch.no_grad():
    logits = {f"logits_{i}": model(torch.tensor([p])).logits[0].numpy().astype(np.float32)
              for i, p in enumerate(prompts)}
  np.savez_compressed(directory / "reference_logits.npz", **logits)
  model.save_pretrained(directory, **SAFE_SERIALIZATION,
                        **({"max_shard_size": spec["max_shard_size"]}
                           if spec["max_shard_size"] else {}))
  chats = []
  for conversation, kwargs in zip(CONVERSATIONS, spec["template_kwargs"]):
    for add_generation_prompt in (True, False):
      text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)
      token_ids = tokenizer.apply_chat_template(conversation, tokenize=True,
                                                add_generation_prompt=add_generation_prompt,
                                                **kwargs)
      chats.append({"messages": conversation, "add_generation_prompt": add_generation_prompt,
                    "kwargs": kwargs, "text": text, "token_ids": list(token_ids)})
  reference = {
      "family": name, "seed": seed + attempt, "transformers": transformers.__version__,
      "torch": torch.__version__, "special_token_ids": ids,
      "prompts": [{"text": text, "token_ids": p, "greedy": cont, "greedy_min_margin": m}
                  for text, p, (cont, m) in zip(PROMPTS, prompts, continuations)],
      "chat": chats,
      "encode": [{"text": text, "token_ids": tokenizer(text, add_special_tokens=False)[
          "input_ids"]} for text in PROMPTS + ["  spaces and 1234567 digits\n\nnew lines "]],
  }
  (directory / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
  return {"family": name, "seed": seed + attempt, "min_margin": margin, "min_distinct": distinct,
          "bytes": sum(f.stat().st_size for f in directory.iterdir())}


# ---- the transformers 5 fixtures: configs in the 5.x layout --------------------------------------
# Random tiny models of each family saved by transformers 5, so that config.json holds RoPE in
# `rope_parameters` (no top-level rope_theta); no tokenizer: prompts are random token ids, and no
# special token ids (transformers 5's LlamaConfig would otherwise write bos 1 and eos 2).
TF5_PROMPT_LENGTHS = (40, 128)
TF5_MIN_DISTINCT = 12  # of the 20 greedy tokens: random token prompts, no repeating tails
TF5_SHAPE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None,
                 eos_token_id=None, pad_token_id=None)
TF5_FIXTURES = {
    # llama3 RoPE scaling: an original length of 64 puts head_dim 16's wavelengths (6, 33, 168,
    # ...) below, inside and above the band between 64 / high_freq_factor and 64.
    "llama-tf5": dict(
        config_class="LlamaConfig", model_class="LlamaForCausalLM",
        config=dict(TF5_SHAPE, intermediate_size=128, head_dim=16, rms_norm_eps=1e-5,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0,
                                     "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64})),
    "qwen2-tf5": dict(
        config_class="Qwen2Config", model_class="Qwen2ForCausalLM",
        config=dict(TF5_SHAPE, intermediate_size=96, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    use_sliding_window=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
    # head_dim 32 with hidden_size 64 and 4 heads: not hidden_size / num_heads.
    "qwen3-tf5": dict(
        config_class="Qwen3Config", model_class="Qwen3ForCausalLM",
        config=dict(TF5_SHAPE, intermediate_size=128, head_dim=32, rms_norm_eps=1e-6,
                    tie_word_embeddings=True, use_sliding_window=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
}
# qwen2-tf5 also records, on its weights, the logits of each variant replacing rope_parameters.
# Theta 1e4 and an original length of 64 put head_dim 16's wavelengths on both sides of the
# llama3 and YaRN thresholds.
ROPE_VARIANTS = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 10_000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
             "rope_theta": 10_000.0},
    "yarn_explicit": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128,
                      "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3,
                      "truncate": False, "rope_theta": 50_000.0},
}
TF5_VARIANTS = {"qwen2-tf5": ROPE_VARIANTS}


def _tf5_model(spec: dict, **overrides):
  config = getattr(transformers, spec["config_class"])(
      attn_implementation="eager", dtype="float32", **{**spec["config"], **overrides})
  return getattr(transformers, spec["model_class"])(config)


def _logits(model, prompts) -> list[np.ndarray]:
  with torch.no_grad():
    return [model(torch.tensor([p])).logits[0].numpy().astype(np.float32) for p in prompts]


def build_tf5_fixture(name: str, seed: int, out: pathlib.Path = OUT) -> dict:
  if not TRANSFORMERS_5:
    raise SystemExit(f"--tf5-fixtures needs transformers >= 5 (the 5.x config layout), found "
                     f"{transformers.__version__}")
  spec = TF5_FIXTURES[name]
  rng = np.random.default_rng(seed)
  vocab_size = spec["config"]["vocab_size"]
  prompts = [rng.integers(0, vocab_size, n).tolist() for n in TF5_PROMPT_LENGTHS]
  model, attempt, continuations, margin, distinct = draw_model(
      name, lambda: _tf5_model(spec), prompts, seed, min_distinct=TF5_MIN_DISTINCT)
  directory = out / name
  shutil.rmtree(directory, ignore_errors=True)
  directory.mkdir(parents=True)
  model.save_pretrained(directory)
  saved = json.loads((directory / "config.json").read_text())
  if "rope_theta" in saved or saved.get("rope_parameters") != spec["config"]["rope_parameters"]:
    raise RuntimeError(f"transformers {transformers.__version__} did not write the 5.x RoPE "
                       f"layout: {saved}")
  logits = {f"default_{i}": x for i, x in enumerate(_logits(model, prompts))}
  variants = TF5_VARIANTS.get(name, {})
  for variant, rope in variants.items():
    other = _tf5_model(spec, rope_parameters=dict(rope)).eval()
    other.load_state_dict(model.state_dict())
    logits.update({f"{variant}_{i}": x for i, x in enumerate(_logits(other, prompts))})
  np.savez_compressed(directory / "reference_logits.npz", **logits)
  reference = {"fixture": name, "seed": seed + attempt, "transformers": transformers.__version__,
               "torch": torch.__version__,
               "prompts": [{"token_ids": p, "greedy": cont, "greedy_min_margin": m}
                           for p, (cont, m) in zip(prompts, continuations)],
               "variants": variants}
  (directory / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
  return {"fixture": name, "seed": seed + attempt, "min_margin": margin,
          "min_distinct": distinct, "transformers": transformers.__version__,
          "bytes": sum(f.stat().st_size for f in directory.iterdir())}


def resave_configs(out: pathlib.Path = OUT) -> list[str]:
  """<out>/configs/fixture-<family>.tf5.json: each 4.x fixture's config.json (read from
  tests/fixtures/hf) as transformers 5 loads and saves it (the 5.x layout of the same model)."""
  if not TRANSFORMERS_5:
    raise SystemExit(f"--resave-configs needs transformers >= 5, found {transformers.__version__}")
  written = []
  (out / "configs").mkdir(parents=True, exist_ok=True)
  for name in sorted(FAMILIES):
    config = transformers.AutoConfig.from_pretrained(OUT / name)
    path = out / "configs" / f"fixture-{name}.tf5.json"
    path.write_text(config.to_json_string(use_diff=True))
    written.append(str(path))
  return written


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--families", nargs="*", default=None,
                      help=f"default: all of {sorted(FAMILIES)}, or with --tf5-fixtures all of "
                           f"{sorted(TF5_FIXTURES)}")
  parser.add_argument("--tf5-fixtures", action="store_true",
                      help="write tests/fixtures/hf/*-tf5 (transformers 5) instead")
  parser.add_argument("--resave-configs", action="store_true",
                      help="write tests/fixtures/hf/configs/fixture-*.tf5.json (transformers 5)")
  parser.add_argument("--out", type=pathlib.Path, default=OUT,
                      help="the folder to write into (default tests/fixtures/hf)")
  args = parser.parse_args()
  torch.set_num_threads(1)
  if args.tf5_fixtures or args.resave_configs:
    if args.tf5_fixtures:
      names = sorted(TF5_FIXTURES) if args.families is None else args.families
      unknown = sorted(set(names) - set(TF5_FIXTURES))
      if unknown:
        parser.error(f"--families with --tf5-fixtures must be in {sorted(TF5_FIXTURES)}, got "
                     f"{unknown}")
      for name in names:
        print(json.dumps(build_tf5_fixture(name, args.seed, args.out)))
    if args.resave_configs:
      print(json.dumps(resave_configs(args.out)))
    return
  names = sorted(FAMILIES) if args.families is None else args.families
  unknown = sorted(set(names) - set(FAMILIES))
  if unknown:
    parser.error(f"--families must be in {sorted(FAMILIES)}, got {unknown}")
  for name in names:
    print(json.dumps(build_family(name, FAMILIES[name], args.seed, args.out)))


if __name__ == "__main__":
  main()
