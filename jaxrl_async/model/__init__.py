"""The decoder (flax.nnx), its configs and its KV cache."""

from jaxrl_async.model.config import PRESETS, ModelConfig, get_config
from jaxrl_async.model.decoder import (
                                       Decoder,
                                       KVCache,
                                       abstract_params,
                                       apply,
                                       init_model,
                                       param_logical_axes,
                                       split_model,
)

__all__ = [
                                       "PRESETS",
                                       "Decoder",
                                       "KVCache",
                                       "ModelConfig",
                                       "abstract_params",
                                       "apply",
                                       "get_config",
                                       "init_model",
                                       "param_logical_axes",
                                       "split_model",
]
