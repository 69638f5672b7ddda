"""config.json -> ModelConfig on the published configs of real models (tests/fixtures/hf/configs,
sources in docs/real_model_configs.md), both transformers layouts of RoPE, the allowlist of keys
and the export back to config.json."""

import dataclasses
import json
import math
import pathlib

import pytest

from jaxrl_async.model import hf_config, hf_keys, weights
from jaxrl_async.model.config import (
  PRESETS,
  LinearRopeScaling,
  ModelConfig,
  RopeScaling,
  YarnRopeScaling,
)
from jaxrl_async.model.hf_config import UnsupportedCheckpoint, config_from_hf, config_to_hf

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "hf"
CONFIGS = FIXTURES / "configs"


def _real(name) -> dict:
  return json.loads((CONFIGS / f"{name}.json").read_text())


def _qwen2(**fields):
  return ModelConfig(qkv_bias=True, rope_theta=1_000_000.0, norm_eps=1e-6, **fields)


def _qwen3(**fields):
  return ModelConfig(qk_norm=True, rope_theta=1_000_000.0, norm_eps=1e-6, **fields)


def _llama(factor, **fields):
  return ModelConfig(rope_theta=500_000.0, norm_eps=1e-5, rope_scaling=RopeScaling(
      factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_position_embeddings=8192), **fields)


# Hand-written from the model cards' shapes: what each published config.json must read as.
# head_dim None is the default d_model / n_heads.
EXPECTED = {
    "qwen2.5-0.5b": _qwen2(vocab_size=151_936, d_model=896, n_layers=24, n_heads=14,
                           n_kv_heads=2, d_ff=4864, max_seq_len=32768, tie_embeddings=True),
    "qwen2.5-1.5b-instruct": _qwen2(vocab_size=151_936, d_model=1536, n_layers=28, n_heads=12,
                                    n_kv_heads=2, d_ff=8960, max_seq_len=32768,
                                    tie_embeddings=True),
    "qwen2.5-7b": _qwen2(vocab_size=152_064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                         d_ff=18944, max_seq_len=131072, tie_embeddings=False),
    "qwen3-0.6b": _qwen3(vocab_size=151_936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                         head_dim=128, d_ff=3072, max_seq_len=40960, tie_embeddings=True),
    "qwen3-4b": _qwen3(vocab_size=151_936, d_model=2560, n_layers=36, n_heads=32, n_kv_heads=8,
                       head_dim=128, d_ff=9728, max_seq_len=40960, tie_embeddings=True),
    "qwen3-8b": _qwen3(vocab_size=151_936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                       d_ff=12288, max_seq_len=40960, tie_embeddings=False),
    "llama3.1-8b": _llama(8.0, vocab_size=128_256, d_model=4096, n_layers=32, n_heads=32,
                          n_kv_heads=8, d_ff=14336, max_seq_len=131072, tie_embeddings=False),
    "llama3.2-1b": _llama(32.0, vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32,
                          n_kv_heads=8, d_ff=8192, max_seq_len=131072, tie_embeddings=True),
    "llama3.2-3b": _llama(32.0, vocab_size=128_256, d_model=3072, n_layers=28, n_heads=24,
                          n_kv_heads=8, d_ff=8192, max_seq_len=131072, tie_embeddings=True),
}
# Other saves of the same models: a transformers 5 re-save (5.x layout) and 4.x re-saves.
RESAVES = {"qwen2.5-1.5b-instruct.tf5": "qwen2.5-1.5b-instruct",
           "qwen3-8b.tf4.57": "qwen3-8b", "llama3.2-3b.tf4.47": "llama3.2-3b"}
# Published configs the decoder must refuse, with the reason named.
REFUSED = {"deepbrainz-r1-4b": r"rope_scaling.rope_type=\"dynamic\".*supported rope_type values"}


# ---- real configs --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_config_reads_as_the_model(name):
  assert config_from_hf(_real(name)) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_config_fields_by_hand(name):
  config, hf = config_from_hf(_real(name)), _real(name)
  assert config.resolved_head_dim == hf.get("head_dim", hf["hidden_size"]
                                            // hf["num_attention_heads"])
  assert config.n_kv_heads == hf["num_key_value_heads"]
  assert config.tie_embeddings is hf["tie_word_embeddings"]
  assert config.rope_theta == float(hf["rope_theta"])
  assert (config.rope_scaling is None) == (hf.get("rope_scaling") is None)


@pytest.mark.parametrize("resave, name", sorted(RESAVES.items()))
def test_resaved_configs_read_like_the_published_one(resave, name):
  assert config_from_hf(_real(resave)) == EXPECTED[name]


@pytest.mark.parametrize("name, message", sorted(REFUSED.items()))
def test_published_config_refused_for_a_named_reason(name, message):
  with pytest.raises(UnsupportedCheckpoint, match=message):
    config_from_hf(_real(name))


@pytest.mark.parametrize("preset, name", [("qwen2.5-0.5b", "qwen2.5-0.5b"),
                                          ("qwen3-0.6b", "qwen3-0.6b"),
                                          ("llama3.2-1b", "llama3.2-1b")])
def test_presets_equal_the_published_configs(preset, name):
  read = config_from_hf(_real(name), max_seq_len=4096, dtype="bfloat16")
  assert read == PRESETS[preset]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_transformers_5_resave_of_each_fixture_reads_the_same(family):
  tf5 = json.loads((CONFIGS / f"fixture-{family}.tf5.json").read_text())
  assert "rope_theta" not in tf5 and "rope_parameters" in tf5
  assert config_from_hf(tf5) == weights.load_config(FIXTURES / family)


# ---- the two layouts -----------------------------------------------------------------------------
def _as_5x(hf: dict) -> dict:
  """`hf` in the layout transformers 5 writes: RoPE in rope_parameters, dtype for torch_dtype,
  layer_types listed for Qwen."""
  out = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
  scaling = dict(hf.get("rope_scaling") or {"rope_type": "default"})
  out["rope_parameters"] = {**scaling, "rope_theta": hf.get("rope_theta", 10_000.0)}
  out["dtype"] = hf.get("torch_dtype", "float32")
  if hf["model_type"] != "llama":
    out["layer_types"] = ["full_attention"] * hf["num_hidden_layers"]
  return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_same_config_in_both_layouts_reads_identically(name):
  hf = _real(name)
  assert config_from_hf(_as_5x(hf)) == config_from_hf(hf) == EXPECTED[name]


def test_5x_theta_is_read_not_defaulted():
  hf = _as_5x(_real("qwen2.5-0.5b"))
  assert "rope_theta" not in hf
  assert config_from_hf(hf).rope_theta == 1_000_000.0
  hf["rope_parameters"] = {"rope_type": "default"}  # no theta anywhere: transformers' 10000
  assert config_from_hf(hf).rope_theta == 10_000.0


def test_both_layouts_in_one_file_must_agree():
  hf = _real("llama3.2-1b")
  both = {**hf, "rope_parameters": _as_5x(hf)["rope_parameters"]}
  assert config_from_hf(both) == EXPECTED["llama3.2-1b"]
  # transformers 5 would read rope_scaling here and ignore rope_parameters, 4.x the reverse of
  # that; either way a file whose layouts disagree is refused
  wrong_theta = {**both, "rope_parameters": {**both["rope_parameters"], "rope_theta": 10_000.0}}
  with pytest.raises(UnsupportedCheckpoint, match=r"rope_parameters=.*it gives RoPE theta "
                     r"10000.0.*give theta 500000.0.*must describe one RoPE"):
    config_from_hf(wrong_theta)
  qwen = _real("qwen2.5-0.5b")
  disagree = {**qwen, "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}}
  with pytest.raises(UnsupportedCheckpoint, match=r"rope_parameters=.*rope_theta=1000000.0, "
                     r"rope_scaling=null give theta 1000000.0"):
    config_from_hf(disagree)
  other_scaling = {**qwen, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                               "rope_theta": 1_000_000.0}}
  with pytest.raises(UnsupportedCheckpoint, match=r"must describe one RoPE"):
    config_from_hf(other_scaling)
  theta_only_on_top = {**qwen, "rope_parameters": {"rope_type": "default"}}
  assert config_from_hf(theta_only_on_top) == EXPECTED["qwen2.5-0.5b"]


def test_rope_theta_inside_rope_scaling_must_match_the_top_level_one():
  hf = _real("llama3.2-1b")
  inner = {**hf, "rope_scaling": {**hf["rope_scaling"], "rope_theta": 10_000.0}}
  with pytest.raises(UnsupportedCheckpoint, match=r"rope_scaling=.*its rope_theta disagrees "
                     r"with rope_theta=500000.0"):
    config_from_hf(inner)
  same = {**hf, "rope_scaling": {**hf["rope_scaling"], "rope_theta": 500_000.0}}
  assert config_from_hf(same) == EXPECTED["llama3.2-1b"]


def test_legacy_type_key_is_read_and_must_agree_with_rope_type():
  qwen = _real("qwen2.5-7b")
  legacy = {**qwen, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 32768}}
  assert config_from_hf(legacy).rope_scaling == YarnRopeScaling(4.0, 32768)
  both = {**qwen, "rope_scaling": {"type": "linear", "rope_type": "yarn", "factor": 4.0}}
  with pytest.raises(UnsupportedCheckpoint, match=r"rope_scaling.type=\"linear\" \(disagrees "
                     r"with rope_type=\"yarn\"\)"):
    config_from_hf(both)


# ---- RoPE types ----------------------------------------------------------------------------------
@pytest.mark.parametrize("rope, expected", [
    ({"rope_type": "default"}, None),
    ({"rope_type": "linear", "factor": 2.0}, LinearRopeScaling(2.0)),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 4096}, RopeScaling(8.0, 1.0, 4.0, 4096)),
    # original_max_position_embeddings defaults to max_position_embeddings, as in transformers 5
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     RopeScaling(8.0, 1.0, 4.0, 131072)),
    ({"rope_type": "yarn", "factor": 4.0}, YarnRopeScaling(4.0, 131072)),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
      "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.25, "truncate": False},
     YarnRopeScaling(4.0, 32768, 16.0, 2.0, 1.25, False)),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0, "beta_slow": None},  # 'or' defaults
     YarnRopeScaling(4.0, 131072, 32.0, 1.0)),
])
def test_rope_types_read_the_same_in_both_layouts(rope, expected):
  qwen = _real("qwen2.5-7b")
  old = {**qwen, "rope_scaling": rope}
  new = _as_5x(old)
  assert config_from_hf(old).rope_scaling == config_from_hf(new).rope_scaling == expected
  assert config_from_hf(new).rope_theta == 1_000_000.0


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope_type=\"dynamic\".*supported rope_type "
     r"values: \['default', 'linear', 'llama3', 'yarn'\]"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, r"\"longrope\""),
    ({"rope_type": "mrope", "mrope_section": [16, 24, 24]}, r"\"mrope\""),
    ({"rope_type": "linear"}, r"factor is missing \(required for rope_type 'linear'\)"),
    ({"rope_type": "yarn", "factor": None}, r"factor is missing"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0},
     r"high_freq_factor is missing"),
    ({"rope_type": "linear", "factor": 0.5}, r"factor=0.5 \(allowed: a number >= 1\)"),
    ({"rope_type": "linear", "factor": "2"}, r"factor=\"2\" \(allowed: a number >= 1\)"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707},
     r"mscale=0.707 \(not a key of rope_type 'yarn'.*mscale_all_dim=0.707"),
    ({"rope_type": "default", "factor": 4.0}, r"factor=4.0 \(not a key of rope_type 'default'"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}, r"truncate=\"yes\""),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     r"low_freq_factor < high_freq_factor"),
])
@pytest.mark.parametrize("layout", ["4.x", "5.x"])
def test_unsupported_rope_is_refused_by_name(rope, message, layout):
  hf = {**_real("qwen2.5-7b"), "rope_scaling": rope}
  hf = _as_5x(hf) if layout == "5.x" else hf
  where = "rope_parameters" if layout == "5.x" else "rope_scaling"
  with pytest.raises(UnsupportedCheckpoint, match=message) as error:
    config_from_hf(hf)
  assert "model_type 'qwen2'" in str(error.value)
  assert where in str(error.value)


def test_rope_fields_of_the_wrong_type_are_refused():
  for key, value in [("rope_scaling", "llama3"), ("rope_parameters", [1.0])]:
    with pytest.raises(UnsupportedCheckpoint, match=rf"{key}=.*allowed: a dict or null"):
      config_from_hf({**_real("qwen3-8b"), key: value})
  with pytest.raises(UnsupportedCheckpoint, match=r"rope_theta=\"1e6\" \(allowed: a number > 1"):
    config_from_hf({**_real("qwen3-8b"), "rope_theta": "1e6"})


# ---- the allowlist -------------------------------------------------------------------------------
FAMILY_EXAMPLE = {"llama": "llama3.1-8b", "qwen2": "qwen2.5-7b", "qwen3": "qwen3-8b"}


@pytest.mark.parametrize("family, change, message", [
    ("qwen2", {"use_sliding_window": True}, r"use_sliding_window=true \(allowed: false"),
    ("qwen3", {"use_sliding_window": True}, r"use_sliding_window=true"),
    ("qwen2", {"layer_types": ["full_attention"] * 27 + ["sliding_attention"]},
     r"layer_types=\[.*\"sliding_attention\"\] \(allowed: \"full_attention\" for every layer"),
    ("qwen3", {"layer_types": ["full_attention"] * 35},
     r"layer_types=.* \(35 entries for num_hidden_layers=36\)"),
    ("llama", {"hidden_act": "gelu"}, r"hidden_act=\"gelu\" \(allowed: \"silu\""),
    ("qwen2", {"hidden_act": "relu"}, r"hidden_act=\"relu\""),
    ("qwen3", {"hidden_act": "gelu_pytorch_tanh"}, r"hidden_act=\"gelu_pytorch_tanh\""),
    ("llama", {"attention_bias": True}, r"attention_bias=true \(allowed: false"),
    ("qwen3", {"attention_bias": True}, r"attention_bias=true"),
    ("llama", {"mlp_bias": True}, r"mlp_bias=true \(allowed: false"),
    ("llama", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 \(allowed: 1.0"),
    ("qwen2", {"attention_dropout": 0.1}, r"attention_dropout=0.1 \(allowed: 0"),
    ("qwen2", {"use_mrope": True}, r"use_mrope=true \(allowed: false"),
    ("llama", {"pruned_heads": {"0": [1]}}, r"pruned_heads="),
    ("qwen2", {"is_encoder_decoder": True}, r"is_encoder_decoder=true"),
    ("llama", {"tie_word_embeddings": "yes"}, r"tie_word_embeddings=\"yes\" \(allowed: true or "),
    ("llama", {"architectures": ["LlamaForSequenceClassification"]},
     r"architectures=\[\"LlamaForSequenceClassification\"\] \(allowed: \['LlamaForCausalLM'\]"),
    ("qwen2", {"architectures": ["LlamaForCausalLM"]}, r"allowed: \['Qwen2ForCausalLM'\]"),
    ("qwen2", {"quantization_config": {"bits": 4}}, r"quantization_config=\{\"bits\": 4\} "
     r"\(quantized weights are not read\)"),
    ("qwen3", {"auto_map": {"AutoModel": "modeling.Model"}}, r"auto_map="),
    ("llama", {"original_max_position_embeddings": 8192},
     r"original_max_position_embeddings=8192"),
    # keys of another family
    ("qwen2", {"attention_bias": False}, r"attention_bias=false \(not a qwen2 setting"),
    ("qwen2", {"mlp_bias": False}, r"mlp_bias=false \(not a qwen2 setting"),
    ("llama", {"use_sliding_window": False}, r"use_sliding_window=false \(not a llama setting"),
    ("llama", {"layer_types": ["full_attention"] * 32}, r"layer_types=.*not a llama setting"),
    # keys no family has
    ("qwen3", {"unsloth_fixed": True}, r"unsloth_fixed=true \(not a qwen3 setting the decoder "
     r"implements or knows to leave the forward pass unchanged\)"),
    ("llama", {"rope_traditional": False}, r"rope_traditional=false"),
])
def test_unknown_and_unsupported_keys_are_refused_by_name(family, change, message):
  with pytest.raises(UnsupportedCheckpoint, match=message) as error:
    config_from_hf({**_real(FAMILY_EXAMPLE[family]), **change})
  assert f"model_type {family!r}" in str(error.value)


@pytest.mark.parametrize("family, change", [
    ("qwen2", {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 3}),
    ("qwen2", {"layer_types": ["full_attention"] * 28, "use_mrope": False}),
    ("qwen3", {"sliding_window": None, "max_window_layers": 0}),
    ("llama", {"pretraining_tp": 2, "attention_bias": False, "mlp_bias": False}),
    ("llama", {"attention_dropout": 0, "partial_rotary_factor": 1.0, "pruned_heads": {}}),
])
def test_allowed_values_read_as_the_unchanged_model(family, change):
  name = FAMILY_EXAMPLE[family]
  assert config_from_hf({**_real(name), **change}) == EXPECTED[name]


@pytest.mark.parametrize("key", sorted(hf_keys.NO_EFFECT_KEYS))
def test_keys_without_effect_are_accepted_whatever_their_value(key):
  hf = {**_real("qwen3-0.6b"), key: {"any": ["value", 1.5]}}
  assert config_from_hf(hf) == EXPECTED["qwen3-0.6b"]


def test_every_bad_key_is_named_in_one_error():
  hf = {**_real("qwen2.5-0.5b"), "foo": 1, "use_sliding_window": True, "hidden_act": "gelu"}
  with pytest.raises(UnsupportedCheckpoint) as error:
    config_from_hf(hf)
  for part in ("foo=1", "use_sliding_window=true", "hidden_act=\"gelu\""):
    assert part in str(error.value)


def test_unknown_model_type_and_missing_fields_are_refused():
  with pytest.raises(UnsupportedCheckpoint, match=r"model_type='mistral'.*supported model_type "
                     r"values: \['llama', 'qwen2', 'qwen3'\]"):
    config_from_hf({**_real("llama3.1-8b"), "model_type": "mistral"})
  hf = _real("qwen3-8b")
  del hf["intermediate_size"]
  with pytest.raises(UnsupportedCheckpoint, match=r"no 'intermediate_size' \(model_type 'qwen3'\)"):
    config_from_hf(hf)
  with pytest.raises(UnsupportedCheckpoint, match=r"num_hidden_layers=0 \(allowed: an integer "
                     r">= 1\)"):
    config_from_hf({**_real("qwen3-8b"), "num_hidden_layers": 0})
  with pytest.raises(UnsupportedCheckpoint, match=r"head_dim=null"):
    config_from_hf({**_real("qwen3-8b"), "head_dim": None})
  with pytest.raises(UnsupportedCheckpoint, match=r"n_heads=32 must be a multiple of "
                     r"n_kv_heads=5"):
    config_from_hf({**_real("qwen3-8b"), "num_key_value_heads": 5})
  with pytest.raises(ValueError, match=r"param_dtype must be one of"):
    config_from_hf(_real("qwen3-8b"), param_dtype="int8")


def test_omitted_keys_take_transformers_defaults_per_family():
  qwen3 = _real("qwen3-8b")
  for key in ("num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
              "tie_word_embeddings"):
    del qwen3[key]
  config = config_from_hf(qwen3)  # Qwen3Config: 32 kv heads, head_dim 128, 32768 positions
  assert (config.n_kv_heads, config.resolved_head_dim, config.max_seq_len) == (32, 128, 32768)
  assert config.norm_eps == 1e-6 and not config.tie_embeddings
  qwen06 = _real("qwen3-0.6b")
  del qwen06["head_dim"]  # 128, not hidden_size / heads = 64
  assert config_from_hf(qwen06).resolved_head_dim == 128
  llama = _real("llama3.2-1b")
  for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
    del llama[key]
  config = config_from_hf(llama)  # LlamaConfig: kv heads = heads, 2048 positions
  assert (config.n_kv_heads, config.resolved_head_dim, config.max_seq_len) == (32, 64, 2048)
  assert config.rope_scaling.original_max_position_embeddings == 8192
  llama_null = {**_real("llama3.2-1b"), "head_dim": None, "num_key_value_heads": None}
  assert config_from_hf(llama_null).n_kv_heads == 32


def test_num_key_value_heads_default_differs_between_families():
  qwen2 = _real("qwen2.5-7b")  # 28 heads: Qwen2Config's default of 32 kv heads cannot divide it
  del qwen2["num_key_value_heads"]
  with pytest.raises(UnsupportedCheckpoint, match=r"n_kv_heads=32"):
    config_from_hf(qwen2)


# ---- export --------------------------------------------------------------------------------------
EXPORTED = [
    *[(name, EXPECTED[name]) for name in sorted(EXPECTED)],
    ("qwen2.5-7b+yarn", dataclasses.replace(EXPECTED["qwen2.5-7b"],
                                            rope_scaling=YarnRopeScaling(4.0, 32768))),
    ("qwen3-8b+yarn-explicit", dataclasses.replace(
        EXPECTED["qwen3-8b"], rope_scaling=YarnRopeScaling(2.0, 4096, 16.0, 2.0, 1.3, False))),
    ("llama3.1-8b+linear", dataclasses.replace(EXPECTED["llama3.1-8b"],
                                               rope_scaling=LinearRopeScaling(4.0))),
]


def _only_4x(hf):
  return {k: v for k, v in hf.items() if k != "rope_parameters"}


def _only_5x(hf):
  return {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling")}


@pytest.mark.parametrize("name, config", EXPORTED, ids=[n for n, _ in EXPORTED])
def test_export_writes_both_layouts_that_read_back_identically(name, config):
  base = _real(name.split("+")[0])
  for exported in (config_to_hf(config, torch_dtype="bfloat16", base=base),
                   config_to_hf(config, torch_dtype="float32")):
    exported = json.loads(json.dumps(exported))  # as written to disk
    assert hf_config.read_rope_4x(exported) == hf_config.read_rope_5x(exported)
    assert exported["rope_parameters"]["rope_theta"] == exported["rope_theta"] == config.rope_theta
    read = dataclasses.replace(config, max_seq_len=config_from_hf(exported).max_seq_len)
    assert config_from_hf(exported) == read
    assert config_from_hf(_only_4x(exported)) == read  # what transformers 4.x reads
    assert config_from_hf(_only_5x(exported)) == read  # what transformers 5.x reads


def test_export_over_a_5x_base_rewrites_its_rope_and_layer_types():
  base = _real("qwen2.5-1.5b-instruct.tf5")
  config = dataclasses.replace(EXPECTED["qwen2.5-1.5b-instruct"], n_layers=4,
                               rope_scaling=YarnRopeScaling(4.0, 32768))
  exported = config_to_hf(config, torch_dtype="bfloat16", base=base)
  assert exported["layer_types"] == ["full_attention"] * 4
  assert exported["rope_parameters"]["rope_type"] == "yarn"
  assert exported["dtype"] == exported["torch_dtype"] == "bfloat16"
  assert config_from_hf(exported) == config


def test_save_params_writes_a_config_json_both_versions_read(tmp_path):
  source = FIXTURES / "llama"
  config = weights.load_config(source)
  weights.save_params(weights.load_params(source, config), config, tmp_path, base=source)
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["rope_scaling"]["rope_type"] == written["rope_parameters"]["rope_type"] == "llama3"
  assert config_from_hf(_only_4x(written)) == config_from_hf(_only_5x(written)) == config


def test_yarn_attention_factor_default_survives_export():
  config = dataclasses.replace(EXPECTED["qwen3-8b"], rope_scaling=YarnRopeScaling(4.0, 32768))
  exported = config_to_hf(config, torch_dtype="bfloat16")
  assert exported["rope_scaling"]["attention_factor"] == pytest.approx(0.1 * math.log(4) + 1)
  assert "truncate" not in exported["rope_scaling"]  # the default, readable by older 4.x
