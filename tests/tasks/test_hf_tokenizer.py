import json
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_async.tasks.chat_template import ChatTemplateError, compile_chat_template, render_chat
from jaxrl_async.tasks.hf_tokenizer import HFTokenizer

from .hf_files import write_llama3_like, write_qwen_like

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
  return HFTokenizer.from_dir(write_qwen_like(tmp_path_factory.mktemp("qwen")))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  return HFTokenizer.from_dir(write_llama3_like(tmp_path_factory.mktemp("llama")))


def test_special_ids_from_the_model_files(qwen, llama):
  # Qwen-like: specials are ids 0, 1, 2 = <|endoftext|>, <|im_start|>, <|im_end|>.
  assert qwen.eos_id == 2 and qwen.stop_ids == (2, 0)  # tokenizer eos, then generation's
  assert qwen.pad_id == 0 and qwen.bos_id is None and qwen.unk_id is None
  assert qwen.vocab_size == 512 and qwen.num_tokens < 512  # config.json's embedding rows
  # Llama-3-like: <|begin_of_text|>=0, <|end_of_text|>=1, <|eot_id|>=4; no pad token -> eos.
  assert llama.bos_id == 0 and llama.eos_id == 4 and llama.stop_ids == (4, 1)
  assert llama.pad_id == 4
  assert llama.special_tokens["bos_token"] == "<|begin_of_text|>"


def test_pad_from_generation_config_and_vocab_without_config(tmp_path):
  directory = write_qwen_like(tmp_path / "m", vocab_size=None)
  config = json.loads((directory / "tokenizer_config.json").read_text())
  config["pad_token"] = None
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  tok = HFTokenizer.from_dir(directory)
  assert tok.pad_id == 0  # generation_config.json pad_token_id
  assert tok.vocab_size == tok.num_tokens


def test_eos_from_generation_config_when_the_tokenizer_names_none(tmp_path):
  directory = write_qwen_like(tmp_path / "m")
  config = json.loads((directory / "tokenizer_config.json").read_text())
  config["eos_token"] = None
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))
  # tokenizer_config's explicit null wins over special_tokens_map; generation_config decides.
  assert HFTokenizer.from_dir(directory).eos_id == 2
  del config["eos_token"]
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  assert HFTokenizer.from_dir(directory).eos_id == 1  # now special_tokens_map's


def test_encode_adds_nothing_unless_asked(qwen, llama):
  ids = llama.encode("Natalia sold clips")
  assert ids.dtype == np.int32 and 0 not in ids.tolist()
  assert llama.encode("Natalia", add_bos=True, add_eos=True).tolist() == (
      [0, *llama.encode("Natalia").tolist(), 4])
  with pytest.raises(ValueError, match="bos"):
    qwen.encode("x", add_bos=True)
  with pytest.raises(TypeError, match="str"):
    qwen.encode(b"x")


def test_special_tokens_in_text_are_single_ids(qwen):
  ids = qwen.encode("<|im_start|>user\nhi<|im_end|>").tolist()
  assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<"),
               max_size=60))
def test_round_trip(qwen, text):
  assert qwen.decode(qwen.encode(text)) == text


def test_decode_stops_and_skips(qwen):
  hi = qwen.encode("hi").tolist()
  ids = hi + [2] + qwen.encode(" more").tolist()
  assert qwen.decode(ids) == "hi<|im_end|> more"
  assert qwen.decode(ids, skip_special=True) == "hi more"
  assert qwen.decode(ids, stop_at_eos=True) == "hi"
  assert qwen.decode(hi + [0] + hi, stop_at_eos=True) == "hi"  # the second stop id
  assert qwen.decode(np.array([hi + [qwen.vocab_size - 1]])) == "hi"  # a row with no token


def test_qwen_chat_template(qwen):
  text = qwen.apply_chat_template(CHAT)
  assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                  "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
  assert qwen.apply_chat_template(CHAT[1:], add_generation_prompt=False) == (
      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
      "<|im_start|>user\nWhat is 2+3?<|im_end|>\n")
  with pytest.raises(ChatTemplateError, match="Unknown role: tool"):
    qwen.apply_chat_template([{"role": "tool", "content": "x"}])


def test_llama3_chat_template(llama):
  chat = [CHAT[0], {"role": "user", "content": "  Hi there \n"}]
  assert llama.apply_chat_template(chat) == (
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n")
  ids = llama.encode(llama.apply_chat_template(chat)).tolist()
  assert ids[0] == llama.bos_id and ids.count(llama.bos_id) == 1
  assert ids.count(llama.eos_id) == 2


def test_additional_special_tokens_reach_the_template(tmp_path):
  directory = write_qwen_like(tmp_path / "m")
  config = json.loads((directory / "tokenizer_config.json").read_text())
  config["additional_special_tokens"] = ["<|im_start|>", {"content": "<|im_end|>"}]
  config["chat_template"] = "{{ additional_special_tokens | join(',') }}|{{ eos_token }}"
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  assert HFTokenizer.from_dir(directory).apply_chat_template(CHAT) == (
      "<|im_start|>,<|im_end|>|<|im_end|>")


def test_trim_and_lstrip_blocks_as_transformers():
  template = compile_chat_template(
      "{% for m in messages %}\n  {% if m.role == 'user' %}\nU:{{ m.content }}\n  {% else %}\n"
      "A:{{ m.content }}\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\nA:\n"
      "{% endif %}")
  chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
  assert render_chat(template, chat) == "U:hi\nA:yo\nA:\n"
  assert render_chat(template, chat, add_generation_prompt=False) == "U:hi\nA:yo\n"


def test_template_helpers_and_context():
  template = compile_chat_template(
      "{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
      "{{ m | tojson }}{% endfor %}{{ extra }}")
  chat = [{"role": "user", "content": "é"}, {"role": "user", "content": "dropped"}]
  assert render_chat(template, chat, special_tokens={"bos_token": "<s>"}, extra="!") == (
      '<s>{"role": "user", "content": "é"}!')
  with pytest.raises(ChatTemplateError, match="does not compile"):
    compile_chat_template("{% for m in messages %}")
  with pytest.raises(ChatTemplateError, match="'content'"):
    render_chat(template, [{"role": "user"}])
  with pytest.raises(ChatTemplateError, match="list"):
    render_chat(template, "hello")


def test_the_sandbox_blocks_attribute_writes():
  template = compile_chat_template("{% set _ = messages.append(1) %}")
  with pytest.raises(ChatTemplateError):
    render_chat(template, [{"role": "user", "content": "x"}])


def test_chat_template_file_and_named_templates(tmp_path):
  directory = write_qwen_like(tmp_path / "m")
  config = json.loads((directory / "tokenizer_config.json").read_text())
  config["chat_template"] = [{"name": "tool_use", "template": "T"},
                             {"name": "default", "template": "D{{ messages | length }}"}]
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  assert HFTokenizer.from_dir(directory).apply_chat_template(CHAT) == "D2"
  (directory / "chat_template.jinja").write_text("J")
  assert HFTokenizer.from_dir(directory).apply_chat_template(CHAT) == "J"
  config["chat_template"] = [{"name": "tool_use", "template": "T"}]
  (directory / "chat_template.jinja").unlink()
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="'default'"):
    HFTokenizer.from_dir(directory)


def test_no_chat_template(tmp_path):
  directory = write_qwen_like(tmp_path / "m")
  config = json.loads((directory / "tokenizer_config.json").read_text())
  del config["chat_template"]
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  tok = HFTokenizer.from_dir(directory)
  assert not tok.has_chat_template
  with pytest.raises(ValueError, match="no chat template"):
    tok.apply_chat_template(CHAT)


def test_pickle_keeps_the_template(qwen):
  again = pickle.loads(pickle.dumps(qwen))
  assert again.apply_chat_template(CHAT) == qwen.apply_chat_template(CHAT)
  assert again.encode("hi").tolist() == qwen.encode("hi").tolist()


def test_bad_directories(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
    HFTokenizer.from_dir(tmp_path)
  directory = write_qwen_like(tmp_path / "m")
  config = json.loads((directory / "tokenizer_config.json").read_text())
  config["eos_token"] = "</s>"
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match=r"eos_token='</s>' is not a token"):
    HFTokenizer.from_dir(directory)
  config["eos_token"] = None
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  (directory / "generation_config.json").unlink()
  (directory / "config.json").write_text(json.dumps({"vocab_size": 512}))
  with pytest.raises(ValueError, match="no eos token"):
    HFTokenizer.from_dir(directory)
  (directory / "config.json").write_text(json.dumps({"vocab_size": 10, "eos_token_id": 2}))
  with pytest.raises(ValueError, match="vocab_size=10"):
    HFTokenizer.from_dir(directory)
  (directory / "config.json").write_text(json.dumps({"eos_token_id": "2"}))
  with pytest.raises(ValueError, match="eos_token_id"):
    HFTokenizer.from_dir(directory)

