"""The decoder (flax.nnx), its configs and its KV cache."""

from jaxrl_async.model.config import PRESETS, ModelConfig, get_config
from jaxrl_async.model.decoder import (Decoder, KVCache, abstract_params, apply, init_model,
                                       param_logical_axes, split_model)

__all__ = ["PRESETS", "ModelConfig", "get_config", "KVCache", "Decoder", "apply", "init_model",
           "split_model", "param_logical_axes", "abstract_params"]
